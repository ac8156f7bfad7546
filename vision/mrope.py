"""M-RoPE positions of a prompt (Qwen2-VL family): 3 x L (temporal, height, width) and the decode offset.

Text tokens take one position on all three rows; an image's tokens take their grid coordinates from
the position where the image starts, and the text after it goes on from past the image's larger
side. The positions come from the model's own ``get_rope_index``, called on its class without an
instance (it reads only the config and ``get_vision_position_ids``), so preparation never loads the
language model. Decoding goes on at ``position + delta`` on all three rows, ``delta`` being
``max(positions) + 1 - L``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from vision.preprocess import GridThw

__all__ = ["MRopeIndex", "MRopePositions"]


@dataclass(frozen=True, slots=True)
class MRopePositions:
    """A prompt's M-RoPE positions."""

    positions: torch.Tensor  # [3, L] int64
    delta: int  # a token at 1-D index i >= L sits at i + delta on every row


class MRopeIndex:
    """The positions of prompts of one checkpoint, by its model class's own ``get_rope_index``."""

    def __init__(self, config: Any, image_token_id: int) -> None:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        model_class: Any = MODEL_MAPPING[type(config)]
        self.model_class = model_class
        self.image_token_id = image_token_id
        self.merge = int(config.vision_config.spatial_merge_size)
        # what get_rope_index reads of ``self``: the config, and its sibling method
        self._shim = SimpleNamespace(config=config)
        self._shim.get_vision_position_ids = functools.partial(model_class.get_vision_position_ids, self._shim)

    def __call__(self, token_ids: Sequence[int], grids: Sequence[GridThw]) -> MRopePositions | None:
        """The positions of ``token_ids`` whose image tokens are ``grids`` (token grids, in prompt
        order); None for a prompt without images (its positions are the 1-D ones)."""
        if not grids:
            return None
        ids = torch.tensor([list(token_ids)])
        types = (ids == self.image_token_id).int()  # mm_token_type_ids: 1 for an image token
        m = self.merge
        patch_grids = torch.tensor([[t, h * m, w * m] for t, h, w in grids])  # the processor's grid, in patches
        positions, deltas = self.model_class.get_rope_index(
            self._shim, ids, mm_token_type_ids=types, image_grid_thw=patch_grids
        )
        return MRopePositions(positions[:, 0].contiguous(), int(deltas.reshape(-1)[0]))
