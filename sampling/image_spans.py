"""Image spans in a prompt, for families whose image tokens attend bidirectionally (Gemma 3).

Such a span must be prefilled in one chunk: a query inside it sees every key of its image, later
ones included, which a chunk that ends inside the span has not computed yet.
"""

from __future__ import annotations

__all__ = ["chunk_end", "span_around", "uncut_prefix"]


def span_around(prompt_ids: list[int], image_token_id: int, position: int) -> tuple[int, int] | None:
    """The image span ``[lo, hi)`` (a run of image tokens) that a cut at ``position`` would split,
    lo < position < hi; None when it splits none."""
    if not 0 < position < len(prompt_ids):
        return None
    if prompt_ids[position - 1] != image_token_id or prompt_ids[position] != image_token_id:
        return None
    lo, hi = position - 1, position + 1
    while lo > 0 and prompt_ids[lo - 1] == image_token_id:
        lo -= 1
    while hi < len(prompt_ids) and prompt_ids[hi] == image_token_id:
        hi += 1
    return lo, hi


def chunk_end(prompt_ids: list[int], image_token_id: int, start: int, end: int) -> int:
    """Where a prefill chunk ``[start, end)`` that must not split an image span ends: at ``end``
    when it splits none, else at the span's start, or, when the chunk starts at that span (which is
    longer than the chunk budget), at the span's end: the span in a chunk of its own."""
    span = span_around(prompt_ids, image_token_id, end)
    if span is None:
        return end
    lo, hi = span
    return lo if lo > start else hi


def uncut_prefix(prompt_ids: list[int], image_token_id: int, num_tokens: int, block_size: int) -> int:
    """The longest prefix of whole blocks, at most ``num_tokens`` long, that splits no image span
    (a cached prefix cut back, so the prefill after it starts at a block boundary outside a span)."""
    while (span := span_around(prompt_ids, image_token_id, num_tokens)) is not None:
        num_tokens = span[0] // block_size * block_size
    return num_tokens
