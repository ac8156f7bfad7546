"""Decode stage: Pillow, then the model's image processor in the same call: in a worker thread, or
in a preparation worker process (``stages/process_pool.py``) that may run the vision encoder too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from pipeline.errors import PipelineError
from stages.offload import Offload
from stages.process_pool import ImagePool
from vision.image_io import check_scalable, decode_image

__all__ = ["DecodeStage"]


class DecodeStage:
    name = "decode"

    def __init__(
        self,
        *,
        max_pixels: int = 40_000_000,
        threads: int = 2,
        inline: bool = False,
        target_longest_edge: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        pool: ImagePool | None = None,
    ) -> None:
        self.max_pixels = max_pixels  # decompression-bomb guard, checked from the header
        self.target_longest_edge = target_longest_edge  # JPEG draft mode decodes no smaller than this
        self.transform = transform  # e.g. the model's preprocessing, done in the same thread hop
        self.pool = pool  # process mode: the work runs there, and its limiter bounds the stage
        self.offload = Offload(anyio.CapacityLimiter(threads), inline=inline)
        self.limiter = pool.limiter if pool is not None else self.offload.limiter

    @property
    def cpu_seconds(self) -> float:
        """CPU time of the stage's work, in threads or in the worker processes."""
        return self.pool.stats.cpu_seconds if self.pool is not None else self.offload.cpu_seconds

    def _decode(self, data: bytes, field: str) -> Any:
        image = decode_image(
            data, max_pixels=self.max_pixels, target_longest_edge=self.target_longest_edge, field=field
        )
        check_scalable(image.size, self.target_longest_edge, field)
        if self.transform is None:
            return image
        try:
            return self.transform(image)
        except PipelineError as exc:  # the transform knows the image, not the request field it came in
            if exc.field is None:
                exc.field = field
            raise

    async def run(self, data: bytes, *, field: str) -> Any:
        """The decoded RGB ``PIL.Image`` (or its transform; with a pool, its ``PreparedImage``).

        :raises ImageDecodeError: not a supported, intact image.
        :raises PayloadTooLarge: over the pixel cap.
        :raises WorkerCrashed, DeadlineExceeded: (process mode) the worker died or was stuck.
        """
        if self.pool is not None:  # the pool holds cancelled work to its end the same way
            try:
                return await self.pool.run(data, field=field)
            except PipelineError as exc:
                raise exc.bind(stage=self.name) from None
        # Cancellation (rule 3 of the README). A caller cancelled while it waits for a limiter token leaves
        # without any work done. Once the work is in a thread, to_thread.run_sync (abandon_on_cancel
        # left False) waits for it inside a shielded scope and returns the limiter token only when the
        # thread has finished, so cancelled work never piles up behind the limiter; it then returns
        # normally, and the checkpoint below delivers the pending cancellation instead of the result.
        # (An anyio cancel scope only: a native asyncio task.cancel() is not held back by the shield.)
        try:
            result = await self.offload.run(self._decode, data, field)
        except PipelineError as exc:
            exc.bind(stage=self.name)  # errors of the transform too
            raise
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result
