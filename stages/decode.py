"""Decode stage: Pillow in a worker thread, then the model's image processor in the same call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from pipeline.config import PipelineConfig
from stages.offload import Offload
from vision.image_io import decode_image

__all__ = ["DecodeStage"]


class DecodeStage:
    name = "decode"

    def __init__(
        self,
        config: PipelineConfig,
        *,
        target_longest_edge: int | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self.max_pixels = config.max_image_pixels
        self.target_longest_edge = target_longest_edge
        self.transform = transform  # e.g. the model's preprocessing, done in the same thread hop
        self.offload = Offload(anyio.CapacityLimiter(config.decode_threads), inline=config.inline_preparation)
        self.limiter = self.offload.limiter

    def _decode(self, data: bytes, field: str) -> Any:
        image = decode_image(
            data, max_pixels=self.max_pixels, target_longest_edge=self.target_longest_edge, field=field
        )
        return self.transform(image) if self.transform is not None else image

    async def run(self, data: bytes, *, field: str) -> Any:
        """The decoded RGB image (or its transform).

        :raises ImageDecodeError: not a supported image. :raises PayloadTooLarge: over the pixel cap.
        """
        return await self.offload.run(self._decode, data, field)
