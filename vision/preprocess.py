"""Image → model input: the checkpoint's image processor, and the image-token layout it implies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from PIL import Image

from vision.grid_images import is_grid_processor, preprocess_grid_image

__all__ = [
    "GridThw",
    "ImageGrid",
    "ImageTokenIds",
    "PreparedImage",
    "expand_image_tokens",
    "preprocess_image",
    "target_longest_edge",
]

# an image's token grid: frames, rows, columns (1 frame for a still image)
GridThw = tuple[int, int, int]


class ImageGrid(Protocol):
    """What the prompt needs of an image: its token grid (a prepared image, or a cached encoding)."""

    @property
    def grid_thw(self) -> GridThw: ...


@dataclass(frozen=True, slots=True)
class PreparedImage:
    # [3, H, W] (H and W multiples of the patch size), or the flattened patches [num_patches,
    # patch_dim] of a dynamic-resolution processor (Qwen2-VL family); None once encoded
    pixel_values: torch.Tensor | None
    # tokens (frames, down, across) the prompt gives the image: patches, or merged patches where the
    # model merges them (Mistral 3, Qwen-VL)
    grid_thw: GridThw
    # [num_tokens, hidden]: the encoder's output where a preparation worker already ran it
    embeds: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.grid_thw[1]

    @property
    def num_cols(self) -> int:
        return self.grid_thw[2]

    @property
    def num_patches(self) -> int:
        """Tokens of the image in the prompt (its embedding rows)."""
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def nbytes(self) -> int:
        """What it holds in memory: its pixels and its embeddings (the encoder cache's weight)."""
        return sum(t.numel() * t.element_size() for t in (self.pixel_values, self.embeds) if t is not None)


@dataclass(frozen=True, slots=True)
class ImageTokenIds:
    """The image token layout: Pixtral's rows closed by break and end tokens, or (Llava with a
    CLIP tower) the image token once per embedding row, nothing between."""

    image: int  # "[IMG]" / "<image>": one per patch, replaced by the patch's embedding
    row_break: int | None  # "[IMG_BREAK]": ends every row but the last (Pixtral)
    image_end: int | None  # "[IMG_END]": ends the image (Pixtral)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, image_token_id: int) -> ImageTokenIds:
        """The layout of ``tokenizer``: Pixtral's when it has [IMG_BREAK] and [IMG_END], plain
        repetition when it has neither.

        :raises ValueError: naming the token the tokenizer lacks when it has only one of them.
        """
        found: dict[str, int | None] = {}
        for token in ("[IMG_BREAK]", "[IMG_END]"):
            token_id = tokenizer.convert_tokens_to_ids(token)
            found[token] = None if token_id is None or token_id == tokenizer.unk_token_id else int(token_id)
        missing = [token for token, token_id in found.items() if token_id is None]
        if len(missing) == 1:
            raise ValueError(f"the tokenizer has no {missing[0]} token, which Pixtral's image layout needs")
        return cls(image=image_token_id, row_break=found["[IMG_BREAK]"], image_end=found["[IMG_END]"])


def target_longest_edge(processor: Any) -> int | None:
    """The longest edge, in pixels, the processor resizes images to (None: it has none, or it
    bounds pixel counts instead, as the Qwen2-VL family does)."""
    if processor is None or is_grid_processor(processor):
        return None
    edge = (getattr(processor, "size", None) or {}).get("longest_edge")
    return int(edge) if edge is not None else None


def preprocess_image(processor: Any, image: Image.Image, *, field: str | None = None) -> PreparedImage:
    """Resize, rescale and normalise one RGB image with the checkpoint's processor (CPU, ~ms).

    Where the model merges ``spatial_merge_size``² patches into one token (Mistral 3), the image is
    resized to whole merged patches and its grid counts tokens, as the model's processor does.

    :raises ImageDecodeError: (dynamic-resolution processors) an image it cannot patch, naming ``field``.
    """
    if is_grid_processor(processor):
        patches, grid = preprocess_grid_image(processor, image, field)
        return PreparedImage(pixel_values=patches, grid_thw=grid)
    patch = processor.patch_size
    merge = int(getattr(processor, "spatial_merge_size", 1) or 1)
    patch_h = (patch["height"] if isinstance(patch, dict) else patch) * merge
    patch_w = (patch["width"] if isinstance(patch, dict) else patch) * merge
    # one image needs no padding to a batch shape (padding showed up as ~10% of a burst's CPU)
    extra: dict[str, Any] = {"do_pad": False} if hasattr(processor, "do_pad") else {}
    if merge > 1:
        extra["patch_size"] = {"height": patch_h, "width": patch_w}
    out = processor(images=[image], return_tensors="pt", **extra)
    if "image_sizes" in out:  # dynamic resolution (Pixtral): the image's own size inside the padding
        height, width = (int(v) for v in out["image_sizes"][0])
    else:  # a fixed size (CLIP): one token per patch of the whole picture
        height, width = out["pixel_values"].shape[-2:]
    pixels = out["pixel_values"][0][:, :height, :width].contiguous()
    return PreparedImage(pixel_values=pixels, grid_thw=(1, height // patch_h, width // patch_w))


def expand_image_tokens(token_ids: list[int], images: Sequence[ImageGrid], ids: ImageTokenIds) -> list[int]:
    """Replace the i-th ``[IMG]`` placeholder with the i-th image's grid of tokens.

    Pixtral's layout: each row is ``num_cols`` × ``[IMG]`` then ``[IMG_BREAK]``; the last row ends
    with ``[IMG_END]`` instead. Without break tokens the rows (of every frame) follow each other
    (Llava with CLIP; Qwen-VL, whose template wraps the placeholder in its vision start and end).

    :raises ValueError: if the number of placeholders differs from the number of images.
    """
    num_placeholders = token_ids.count(ids.image)
    if num_placeholders != len(images):
        raise ValueError(f"{num_placeholders} image placeholders for {len(images)} images")
    out: list[int] = []
    next_image = iter(images)
    for token in token_ids:
        if token != ids.image:
            out.append(token)
            continue
        frames, num_rows, num_cols = next(next_image).grid_thw
        row = [ids.image] * num_cols
        for r in range(frames * num_rows):
            out.extend(row)
            closing = ids.image_end if r == frames * num_rows - 1 else ids.row_break
            if closing is not None:
                out.append(closing)
    return out
