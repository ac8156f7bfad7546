"""Dynamic-resolution processors of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

The processor resizes each image to whole merged patches inside a pixel budget (``min_pixels`` to
``max_pixels``, its ``size``'s ``shortest_edge`` and ``longest_edge``: pixel counts, not edges), and
returns the patches flattened, ``[num_patches, channels * temporal_patch * patch * patch]``, with the
image's patch grid ``image_grid_thw``. The prompt holds one ``<|image_pad|>`` per merged token:
``t * h * w // merge_size²`` of them, as the family's processor expands it.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from pipeline.errors import ImageDecodeError

__all__ = ["check_grid_size", "is_grid_processor", "preprocess_grid_image"]


def is_grid_processor(processor: Any) -> bool:
    """Whether ``processor`` gives each image its own patch grid (``image_grid_thw``)."""
    return "image_grid_thw" in (getattr(processor, "model_input_names", None) or ())


def check_grid_size(processor: Any, size: tuple[int, int], field: str | None) -> None:
    """Refuse an image the processor cannot patch within its pixel budget.

    The size rule is the processor's own (``smart_resize``): it refuses an aspect ratio over 200:1,
    and an image so thin that even its shorter side at one merged patch puts it over ``max_pixels``.

    :raises ImageDecodeError: naming ``field`` and the sizes involved.
    """
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    width, height = size
    factor = int(processor.patch_size) * int(processor.merge_size)
    max_pixels = int(processor.size["longest_edge"])
    try:
        resized_h, resized_w = smart_resize(
            height, width, factor, min_pixels=int(processor.size["shortest_edge"]), max_pixels=max_pixels
        )
    except ValueError as exc:
        raise ImageDecodeError(f"the image is {width}x{height} pixels: {exc}", field=field, stage="decode") from None
    if resized_h * resized_w > max_pixels:
        raise ImageDecodeError(
            f"the image is {width}x{height} pixels: the model's processor would patch it as {resized_w}x{resized_h}, "
            f"over its limit of {max_pixels} pixels (its aspect ratio is too extreme)",
            field=field,
            stage="decode",
        )


def preprocess_grid_image(
    processor: Any, image: Image.Image, field: str | None
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The image's flattened patches ``[num_patches, patch_dim]`` and its token grid (frames, rows,
    columns of merged patches).

    :raises ImageDecodeError: see ``check_grid_size``.
    """
    check_grid_size(processor, image.size, field)
    out = processor(images=[image], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    merge = int(processor.merge_size)
    return out["pixel_values"].contiguous(), (t, h // merge, w // merge)
