"""Image → model input: the checkpoint's image processor, and the image-token layout it implies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from PIL import Image

__all__ = ["ImageGrid", "ImageTokenIds", "PreparedImage", "expand_image_tokens", "preprocess_image"]


class ImageGrid(Protocol):
    """What the prompt needs of an image: its patch grid (a prepared image, or a cached encoding)."""

    @property
    def num_rows(self) -> int: ...

    @property
    def num_cols(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PreparedImage:
    pixel_values: torch.Tensor | None  # [3, H, W], H and W multiples of the patch size; None once encoded
    num_rows: int  # patches down
    num_cols: int  # patches across
    # [num_patches, hidden]: the encoder's output where a preparation worker already ran it
    embeds: torch.Tensor | None = None

    @property
    def num_patches(self) -> int:
        return self.num_rows * self.num_cols


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


def preprocess_image(processor: Any, image: Image.Image) -> PreparedImage:
    """Resize, rescale and normalise one RGB image with the checkpoint's processor (CPU, ~ms).

    Where the model merges ``spatial_merge_size``² patches into one token (Mistral 3), the image is
    resized to whole merged patches and its grid counts tokens, as the model's processor does."""
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
    return PreparedImage(pixel_values=pixels, num_rows=height // patch_h, num_cols=width // patch_w)


def expand_image_tokens(token_ids: list[int], images: Sequence[ImageGrid], ids: ImageTokenIds) -> list[int]:
    """Replace the i-th ``[IMG]`` placeholder with the i-th image's grid of tokens.

    Pixtral's layout: each row is ``num_cols`` × ``[IMG]`` then ``[IMG_BREAK]``; the last row ends
    with ``[IMG_END]`` instead. Without break tokens the rows follow each other (Llava with CLIP).

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
        image = next(next_image)
        row = [ids.image] * image.num_cols
        for r in range(image.num_rows):
            out.extend(row)
            closing = ids.image_end if r == image.num_rows - 1 else ids.row_break
            if closing is not None:
                out.append(closing)
    return out
