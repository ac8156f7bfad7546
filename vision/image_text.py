"""Image placeholders a processor expands in text before tokenizing (Gemma 3).

Gemma 3's template writes ``<start_of_image>`` once per image, and its processor replaces each with
``"\\n\\n<start_of_image>"`` + ``mm_tokens_per_image`` × ``<image_soft_token>`` + ``"<end_of_image>\\n\\n"``
in the text, then tokenizes: the newlines merge with those around them (the template's ``"\\n"``
before an image, the next image's ``"\\n\\n"``), so the expansion must happen in text, as the
processor does, not in token ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vision.preprocess import ImageGrid

__all__ = ["ImageText"]


@dataclass(frozen=True, slots=True)
class ImageText:
    """A layout expanded in text: each ``placeholder`` becomes ``expansion``, which holds
    ``num_tokens`` image tokens."""

    placeholder: str  # "<start_of_image>": what the template writes per image
    placeholder_id: int
    expansion: str
    num_tokens: int  # image tokens per image (a fixed grid, whatever the image's size)

    @classmethod
    def from_checkpoint(cls, config: Any, tokenizer: Any) -> ImageText | None:
        """Gemma 3's layout when ``config`` pools every image to ``mm_tokens_per_image`` tokens between
        ``boi_token_index`` and ``eoi_token_index``; None for every other layout."""
        names = ("boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image")
        values = [getattr(config, name, None) for name in names]
        if any(v is None for v in values):
            return None
        boi, eoi, image, num_tokens = (int(v) for v in values if v is not None)
        boi_text, eoi_text, image_text = tokenizer.convert_ids_to_tokens([boi, eoi, image])
        return cls(
            placeholder=boi_text,
            placeholder_id=boi,
            expansion=f"\n\n{boi_text}{image_text * num_tokens}{eoi_text}\n\n",
            num_tokens=num_tokens,
        )

    def _check(self, num_placeholders: int, images: Sequence[ImageGrid]) -> None:
        if num_placeholders != len(images):
            raise ValueError(f"{num_placeholders} image placeholders for {len(images)} images")
        for image in images:
            frames, rows, cols = image.grid_thw
            num_tokens = frames * rows * cols
            if num_tokens != self.num_tokens:
                raise ValueError(f"an image of {num_tokens} tokens; the model takes {self.num_tokens}")

    def expand_text(self, text: str, images: Sequence[ImageGrid], *, typed_after: str | None = None) -> str:
        """``text`` with every placeholder expanded, as the processor does before tokenizing;
        ``typed_after``: what precedes a placeholder's text that a client typed (a marker), left as is.

        :raises ValueError: if the number of placeholders differs from the number of images.
        """
        unmarked = f"(?<!{re.escape(typed_after)})" if typed_after else ""
        pattern = re.compile(unmarked + re.escape(self.placeholder))
        self._check(len(pattern.findall(text)), images)
        return pattern.sub(lambda _: self.expansion, text)

    def expand_ids(self, token_ids: list[int], images: Sequence[ImageGrid], tokenizer: Any) -> list[int]:
        """``token_ids`` (a prompt given as ids) with every placeholder id replaced by the expansion's ids.

        :raises ValueError: if the number of placeholders differs from the number of images.
        """
        self._check(token_ids.count(self.placeholder_id), images)
        expansion = tokenizer.encode(self.expansion, add_special_tokens=False)
        out: list[int] = []
        for token in token_ids:
            out += expansion if token == self.placeholder_id else [token]
        return out
