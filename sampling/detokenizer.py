"""Incremental detokenization that is exact across multi-byte UTF-8 boundaries.

Byte-level vocabularies (tekken, Llama 3, GPT-2 style) map each token to raw bytes; the text is their
concatenation. An incremental UTF-8 decoder holds back a partial character until its last byte
arrives, so a streamed delta never carries a replacement character for a split code point.

Special tokens write no text unless the request asks for them (``skip_special_tokens=False``), as
transformers' ``decode`` does: special means any added token the tokenizer marks special, not only
the few it names (``all_special_ids``: BOS, EOS, ...), so Qwen2.5-VL's ``<|vision_start|>`` is special
too. Written, a special token is its own text with nothing around it, as transformers' ``decode`` and
vLLM's detokenizer write it for a byte-level vocabulary whatever ``spaces_between_special_tokens`` says
(their decoder puts no space between tokens; vLLM's option removes spaces a decoder adds).
"""

from __future__ import annotations

import codecs

__all__ = ["Detokenizer", "TokenBytes", "special_token_ids"]


class TokenBytes:
    """The bytes each token id stands for: ``table`` with special tokens standing for nothing,
    ``with_specials`` with their own text."""

    def __init__(self, decoded_vocab: list[bytes], special_ids: set[int]) -> None:
        self.with_specials = list(decoded_vocab)
        self.table = [b"" if i in special_ids else raw for i, raw in enumerate(decoded_vocab)]

    @classmethod
    def from_tokenizer(cls, tokenizer_info: object, tokenizer: object) -> TokenBytes:
        decoded = list(tokenizer_info.decoded_vocab)  # type: ignore[attr-defined]
        return cls(decoded, special_token_ids(tokenizer_info, tokenizer))


def special_token_ids(tokenizer_info: object, tokenizer: object) -> set[int]:
    """The ids transformers' ``decode(skip_special_tokens=True)`` drops: the tokenizer's named special
    tokens and every added token marked special (xgrammar's special ids too)."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special.update(tokenizer_info.special_token_ids)  # type: ignore[attr-defined]
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(i for i, token in added.items() if getattr(token, "special", False))
    return special


class Detokenizer:
    """Turns a stream of token ids into text deltas (``skip_special_tokens``: special tokens write nothing)."""

    def __init__(self, token_bytes: TokenBytes, *, skip_special_tokens: bool = True) -> None:
        self._table = token_bytes.table if skip_special_tokens else token_bytes.with_specials
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def add(self, token_id: int) -> str:
        """Text that became complete with this token (may be empty)."""
        raw = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        delta = self._decoder.decode(raw)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever partial character is left at the end of the sequence."""
        delta = self._decoder.decode(b"", final=True)
        self.text += delta
        return delta
