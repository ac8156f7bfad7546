"""Image spans that attend bidirectionally (Gemma 3): the scheduler never splits one across prefill
chunks, nor starts a chunk inside one after a prefix-cache hit or a preemption, and the paged
attention lets a query see every key of its own span, as transformers' token_type_ids masks do."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sampling.image_spans import chunk_end, span_around, uncut_prefix
from sampling.inputs import ImageKey
from sampling.kv_cache import BlockAllocator
from sampling.paged_attention import AttentionBatch, image_span_ids
from sampling.params import SamplingParams
from sampling.scheduler import PrefillStep, Scheduler
from sampling.sequence import Sequence

IMG = 7
BLOCK = 4
# text 0..4, a span [5, 15), text 15..17, a span [18, 21), text 21..23
PROMPT = [1, 2, 3, 4, 5, *[IMG] * 10, 8, 9, 10, *[IMG] * 3, 11, 12, 13]
SPANS = [(5, 15), (18, 21)]


def _seq(seq_id: int, prompt: list[int]) -> Sequence:
    # the scheduler reads only the tokens and the block bookkeeping of a sequence
    none: Any = None
    return Sequence(seq_id, f"r{seq_id}", 0, list(prompt), None, SamplingParams(max_tokens=4), None, none, None, none)


def _splits(position: int) -> bool:
    return any(lo < position < hi for lo, hi in SPANS)


def test_span_around_finds_the_span_a_cut_would_split() -> None:
    assert span_around(PROMPT, IMG, 5) is None  # at a span's start
    assert span_around(PROMPT, IMG, 15) is None  # at its end
    assert span_around(PROMPT, IMG, 6) == (5, 15)
    assert span_around(PROMPT, IMG, 14) == (5, 15)
    assert span_around(PROMPT, IMG, 20) == (18, 21)
    assert span_around(PROMPT, IMG, len(PROMPT)) is None


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, 4, 4),  # splits nothing
        (0, 8, 5),  # would split the first span: ends at its start
        (5, 8, 15),  # starts at a span longer than the budget: the span alone
        (5, 20, 18),  # would split the second span: ends at its start
        (15, 19, 18),
        (18, 20, 21),
        (18, 24, 24),
    ],
)
def test_a_chunk_ends_before_a_span_it_would_split_or_after_it_when_it_starts_there(
    start: int, end: int, expected: int
) -> None:
    assert chunk_end(PROMPT, IMG, start, end) == expected


def test_a_cached_prefix_is_cut_back_to_whole_blocks_before_the_span() -> None:
    assert uncut_prefix(PROMPT, IMG, 4, BLOCK) == 4  # before the span
    assert uncut_prefix(PROMPT, IMG, 8, BLOCK) == 4  # inside [5, 15): back to block 1's start
    assert uncut_prefix(PROMPT, IMG, 12, BLOCK) == 4
    assert uncut_prefix(PROMPT, IMG, 16, BLOCK) == 16  # after it
    assert uncut_prefix(PROMPT, IMG, 20, BLOCK) == 16  # inside [18, 21)
    # a span that starts in block 0: back to nothing
    assert uncut_prefix([1, IMG, IMG, IMG, IMG, IMG, 2], IMG, 4, BLOCK) == 0


def _prefill_chunks(scheduler: Scheduler, seq: Sequence, *, add: bool = True) -> list[tuple[int, int]]:
    """Schedule ``seq``'s whole prefill, as the engine would (each chunk computed once scheduled)."""
    if add:
        scheduler.add(seq)
    chunks = []
    while True:
        step = scheduler.schedule().step
        assert isinstance(step, PrefillStep)
        chunks.append((step.start, step.end))
        seq.num_computed = step.end
        scheduler.cache_computed(seq)
        if step.is_last_chunk:
            return chunks


@pytest.mark.parametrize("chunk_tokens", [1, 3, 4, 6, 8, 11, 16])
def test_the_scheduler_never_splits_a_span_whatever_the_chunk_budget(chunk_tokens: int) -> None:
    scheduler = Scheduler(
        BlockAllocator(32),
        block_size=BLOCK,
        max_running=4,
        chunk_tokens=chunk_tokens,
        image_token_id=IMG,
        atomic_image_spans=True,
    )
    chunks = _prefill_chunks(scheduler, _seq(0, PROMPT))
    assert chunks[0][0] == 0 and chunks[-1][1] == len(PROMPT)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))  # contiguous
    assert not any(_splits(end) for _, end in chunks)
    for start, end in chunks:  # a chunk over budget is exactly one span
        assert end - start <= chunk_tokens or (start, end) in SPANS


def test_without_atomic_spans_the_budget_alone_cuts() -> None:
    scheduler = Scheduler(BlockAllocator(32), block_size=BLOCK, max_running=4, chunk_tokens=4, image_token_id=IMG)
    chunks = _prefill_chunks(scheduler, _seq(0, PROMPT))
    assert any(_splits(end) for _, end in chunks)  # the rule above is the scheduler's, not the prompt's


def test_a_prefix_hit_that_ends_inside_a_span_starts_the_prefill_before_it() -> None:
    scheduler = Scheduler(
        BlockAllocator(32),
        block_size=BLOCK,
        max_running=4,
        chunk_tokens=64,
        prefix_caching=True,
        image_token_id=IMG,
        atomic_image_spans=True,
    )
    first = _seq(0, PROMPT)
    first.image_keys = [ImageKey("a", 10), ImageKey("b", 3)]
    assert _prefill_chunks(scheduler, first) == [(0, len(PROMPT))]
    scheduler.release(first)  # finished: its blocks stay in the cache
    # the first prompt's first 16 tokens: its blocks 0, 1 and 2 are cached (block 3 holds the last
    # token, which is always computed), and the third ends inside the span [5, 15)
    second = _seq(1, PROMPT[:16])
    second.image_keys = [ImageKey("a", 10)]
    assert _prefill_chunks(scheduler, second) == [(4, 16)]  # block 0 only: 1 and 2 hold part of the span
    assert scheduler.allocator.stats.hits == 1
    # a preempted sequence comes back the same way, though all its own blocks are cached now
    scheduler._preempt(second)
    assert _prefill_chunks(scheduler, second, add=False) == [(4, 16)]


def test_a_query_in_a_span_sees_its_whole_span_and_nothing_else_ahead() -> None:
    chunk = torch.tensor([3, IMG, IMG, IMG, 4, IMG, IMG, 5])
    start, window = 2, 3
    spans = image_span_ids(chunk == IMG, start)
    assert spans.tolist() == [[-1, -1, -1, 0, 0, 0, -1, 1, 1, -1]]
    length = start + len(chunk)
    batch = AttentionBatch(
        positions=torch.arange(start, length)[None],
        slot_mapping=torch.arange(start, length),
        key_slots=torch.arange(length)[None],
        key_valid=torch.ones(1, length, dtype=torch.bool),
        image_spans=spans,
    )
    image = [False, False, *(chunk == IMG).tolist()]
    span = spans[0].tolist()
    for sliding in (None, window):
        mask = batch.mask(sliding)[0, 0]
        for qi, q in enumerate(range(start, length)):
            for k in range(length):
                # transformers: OR(causal, same image); on sliding layers AND(window, that)
                visible = k <= q or (image[q] and span[k] == span[q])
                if sliding is not None:
                    visible = visible and k > q - sliding
                assert bool(mask[qi, k]) == visible, (sliding, q, k)
    assert bool(batch.mask(None)[0, 0, 1, 5])  # the span's first token sees its last
    assert not bool(batch.mask(None)[0, 0, 1, 7])  # but not the next image's tokens
