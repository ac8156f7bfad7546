"""Several waiting prompts' chunks in one prefill step (``max_prefill_seqs``), within the chunk's
token budget; a sequence that forks into n > 1 prefills alone."""

from __future__ import annotations

from typing import Any

import pytest

from sampling.kv_cache import BlockAllocator
from sampling.params import SamplingParams
from sampling.scheduler import PrefillBatch, Scheduler
from sampling.sequence import Sequence
from tests.sampling.helpers import scheduler_steps

BLOCK = 4


def _seq(seq_id: int, length: int, n: int = 1) -> Sequence:
    # the scheduler reads only the tokens and the block bookkeeping of a sequence
    none: Any = None
    prompt = list(range(100 * seq_id, 100 * seq_id + length))
    params = SamplingParams(max_tokens=64, n=n)
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, None, params, None, none, None, none, num_siblings=n)


def _scheduler(max_prefill_seqs: int = 8, **overrides: Any) -> Scheduler:
    return Scheduler(
        BlockAllocator(64),
        block_size=BLOCK,
        max_running=8,
        chunk_tokens=32,
        chunk_tokens_with_decodes=12,
        max_prefill_seqs=max_prefill_seqs,
        **overrides,
    )


def test_short_prompts_beside_decodes_share_prefill_steps_within_the_budget() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq(0, 3))
    assert scheduler_steps(scheduler, 1) == [("prefill", 0, 0, 3)]
    for seq_id in (1, 2, 3, 4):
        scheduler.add(_seq(seq_id, 5))
    # 12 tokens a step beside the decode: two whole prompts and 2 tokens of the third, whose prompt
    # goes on first in the next prefill step
    assert scheduler_steps(scheduler, 4) == [
        ("decode", 0),
        ("prefills", (1, 0, 5), (2, 0, 5), (3, 0, 2)),
        ("decode", 0, 1, 2),
        ("prefills", (3, 2, 5), (4, 0, 5)),
    ]


def test_one_sequence_a_step_without_batching() -> None:
    scheduler = _scheduler(max_prefill_seqs=1)
    scheduler.add(_seq(0, 3))
    scheduler.add(_seq(1, 5))
    scheduler.add(_seq(2, 5))
    assert scheduler_steps(scheduler, 3) == [("prefill", 0, 0, 3), ("decode", 0), ("prefill", 1, 0, 5)]


def test_at_most_max_prefill_seqs_chunks_a_step() -> None:
    scheduler = _scheduler(max_prefill_seqs=2)
    for seq_id in (0, 1, 2):
        scheduler.add(_seq(seq_id, 3))
    assert scheduler_steps(scheduler, 2) == [("prefills", (0, 0, 3), (1, 0, 3)), ("decode", 0, 1)]


def test_a_sequence_that_forks_prefills_alone() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq(0, 3))
    scheduler.add(_seq(1, 3, n=2))
    scheduler.add(_seq(2, 3))
    scheduler.add(_seq(3, 3))
    steps = scheduler_steps(scheduler, 4)
    assert steps[:2] == [("prefill", 0, 0, 3), ("decode", 0)]
    assert steps[2] == ("prefill", 1, 0, 3)  # n = 2 waits alone, not after sequence 0's chunk
    assert steps[3] == ("decode", 0, 1)


def test_max_prefill_seqs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_prefill_seqs"):
        _scheduler(max_prefill_seqs=0)


def test_decodes_join_a_step_of_short_chunks() -> None:
    scheduler = _scheduler(mixed_chunk_tokens=5)
    scheduler.add(_seq(0, 3))
    assert scheduler_steps(scheduler, 1) == [("prefill", 0, 0, 3)]
    scheduler.add(_seq(1, 5))
    scheduler.add(_seq(2, 9))
    # a 5-token chunk is short: the decode joins its forward, and its 5 tokens are the mixed step's
    # whole prefill budget; the step after it may prefill again, as after a decode step, but a
    # 9-token chunk is too long for the decodes to join
    assert scheduler_steps(scheduler, 4) == [
        ("decode", 0),
        ("mixed", (0,), (1, 0, 5)),
        ("prefill", 2, 0, 9),
        ("decode", 0, 1, 2),
    ]


def test_a_replay_with_all_but_its_last_token_cached_is_a_chunk_not_a_decode() -> None:
    """Such a replay is not prefilling (its cached prefix reaches its last token), yet its last token
    is its chunk: a mixed step must not decode it too."""
    scheduler = _scheduler(prefix_caching=True, mixed_chunk_tokens=12)
    first, second, third = _seq(0, 7), _seq(1, 7), _seq(2, 3)
    for seq in (first, second, third):
        scheduler.add(seq)
    steps = [("prefills", (0, 0, 7), (1, 0, 7), (2, 0, 3)), ("decode", 0, 1, 2)]
    assert scheduler_steps(scheduler, 2) == steps
    for seq in (first, second):
        scheduler.cache_computed(seq)
    scheduler._preempt(second)  # oldest first in the queue: [first, second]
    scheduler._preempt(first)
    assert first.num_tokens == second.num_tokens == 9
    step = scheduler.schedule().step
    assert isinstance(step, PrefillBatch) and step.decodes == [third]
    assert [(c.seq.seq_id, c.start, c.end) for c in step.chunks] == [(0, 8, 9), (1, 8, 9)]
