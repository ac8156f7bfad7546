"""Incremental detokenization that is exact across multi-byte UTF-8 boundaries.

Byte-level vocabularies (tekken, Llama 3, GPT-2 style) map each token to raw bytes; the text is their
concatenation. An incremental UTF-8 decoder holds back a partial character until its last byte
arrives, so a streamed delta never carries a replacement character for a split code point.
"""

from __future__ import annotations

import codecs

__all__ = ["Detokenizer", "TokenBytes"]


class TokenBytes:
    """The bytes each token id stands for; special tokens stand for nothing."""

    def __init__(self, decoded_vocab: list[bytes], special_ids: set[int]) -> None:
        self.table = [b"" if i in special_ids else raw for i, raw in enumerate(decoded_vocab)]

    @classmethod
    def from_tokenizer(cls, tokenizer_info: object, tokenizer: object) -> TokenBytes:
        decoded = list(tokenizer_info.decoded_vocab)  # type: ignore[attr-defined]
        special = set(getattr(tokenizer, "all_special_ids", ()))
        special.update(tokenizer_info.special_token_ids)  # type: ignore[attr-defined]
        return cls(decoded, special)


class Detokenizer:
    """Turns a stream of token ids into text deltas."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._table = token_bytes.table
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
