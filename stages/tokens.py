"""Three questions the template stage and its users ask of a tokenizer: which one token writes a text,
which tokens a plain text is, and how a prompt starts (its BOS, where the tokenizer has one)."""

from __future__ import annotations

from typing import Any

__all__ = ["single_token_id", "text_ids", "with_bos"]


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``tokenizer``'s one token whose text is ``text``; None when it writes it in several."""
    token = tokenizer.convert_tokens_to_ids(text)
    return None if token is None or token == tokenizer.unk_token_id else int(token)


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids, no special tokens added (a request's ``bad_words``, a grammar's forced text)."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def with_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` starting with the tokenizer's BOS (in place), as a chat template starts them: some
    tokenizers add none when asked to add their special tokens."""
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids
