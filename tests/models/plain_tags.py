"""A Qwen3 checkpoint whose tokenizer has no ``<tool_call>`` token, for the tool-call tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.models.checkpoints import FAMILIES, build_family

__all__ = ["NEWLINE_MARKER", "build_multi_token_qwen"]

# the variant's one token that holds the marker with the newline before it (so "<tool_call>" alone
# is no token of it)
NEWLINE_MARKER = "\n<tool_call>"


def build_multi_token_qwen(folder: Path) -> Path:
    """Qwen3 whose tokenizer has no ``<tool_call>`` token: it writes it in byte-level pieces, or in
    one added (not special) token together with the newline before it."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    specials = [s for s in FAMILIES["qwen3"].specials if "tool_call" not in s]
    build_family(dataclasses.replace(FAMILIES["qwen3"], name="qwen3-plain-tags", specials=specials), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([AddedToken(NEWLINE_MARKER, special=False, normalized=False)])
    tokenizer.save_pretrained(folder)
    return folder
