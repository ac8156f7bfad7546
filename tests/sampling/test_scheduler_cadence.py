"""The prefill cadence while sequences decode: ``decode_steps_per_prefill`` decode steps between two
prefill chunks, no holding when nothing decodes, every waiting sequence admitted in turn, and
preemption, abort, n > 1 and image spans as without it."""

from __future__ import annotations

from typing import Any

import pytest

from sampling.kv_cache import BlockAllocator
from sampling.params import SamplingParams
from sampling.scheduler import Scheduler
from sampling.sequence import Sequence
from tests.sampling.helpers import scheduler_steps

IMG = 7
BLOCK = 4


def _seq(seq_id: int, prompt: list[int], n: int = 1) -> Sequence:
    # the scheduler reads only the tokens and the block bookkeeping of a sequence
    none: Any = None
    params = SamplingParams(max_tokens=64)
    return Sequence(seq_id, f"r{seq_id}", 0, list(prompt), None, params, None, none, None, none, num_siblings=n)


def _scheduler(every: int, num_blocks: int = 64, atomic: bool = False) -> Scheduler:
    return Scheduler(
        BlockAllocator(num_blocks),
        block_size=BLOCK,
        max_running=8,
        chunk_tokens=16,
        chunk_tokens_with_decodes=4,
        decode_steps_per_prefill=every,
        image_token_id=IMG,
        atomic_image_spans=atomic,
    )


def _decoding(scheduler: Scheduler, seq_id: int = 0) -> Sequence:
    """A sequence prefilled alone (nothing decodes: no holding) and now decoding."""
    seq = _seq(seq_id, [1, 2, 3])
    scheduler.add(seq)
    assert scheduler_steps(scheduler, 1) == [("prefill", seq_id, 0, 3)]
    return seq


D0 = ("decode", 0)


def test_a_chunked_prefill_beside_a_decode_waits_the_decode_steps_between_chunks() -> None:
    scheduler = _scheduler(every=3)
    _decoding(scheduler)
    scheduler.add(_seq(1, list(range(20, 30))))  # 10 tokens: three chunks of 4 beside a decode
    assert scheduler_steps(scheduler, 13) == [
        *[D0] * 3,
        ("prefill", 1, 0, 4),
        *[D0] * 3,
        ("prefill", 1, 4, 8),
        *[D0] * 3,
        ("prefill", 1, 8, 10),
        ("decode", 0, 1),
    ]


@pytest.mark.parametrize("every", [1, 2, 3, 5])
def test_each_waiting_sequence_is_admitted_after_exactly_the_bound(every: int) -> None:
    """Waiting prompts are admitted in order, one per ``every + 1`` steps: the i-th starts at step
    ``i * (every + 1) - 1``, and the decodes grow by one each time (1: today's alternation)."""
    scheduler = _scheduler(every)
    _decoding(scheduler)
    for i in range(1, 5):
        scheduler.add(_seq(i, [i, i, i]))
    expected: list[tuple[Any, ...]] = []
    running = [0]
    for i in range(1, 5):
        expected += [("decode", *running)] * every + [("prefill", i, 0, 3)]
        running.append(i)
    assert scheduler_steps(scheduler, 4 * (every + 1) + 1) == [*expected, ("decode", 0, 1, 2, 3, 4)]


def test_nothing_decoding_nothing_is_held() -> None:
    scheduler = _scheduler(every=4)
    scheduler.add(_seq(1, list(range(20, 60))))  # 40 tokens: three full chunks, back to back
    scheduler.add(_seq(2, list(range(20, 30))))
    assert scheduler_steps(scheduler, 8) == [
        ("prefill", 1, 0, 16),
        ("prefill", 1, 16, 32),
        ("prefill", 1, 32, 40),
        *[("decode", 1)] * 4,  # from here 1 decodes: 2 is held
        ("prefill", 2, 0, 4),
    ]


def test_a_held_prefill_runs_at_once_when_the_decodes_finish() -> None:
    scheduler = _scheduler(every=4)
    seq = _decoding(scheduler)
    scheduler.add(_seq(1, list(range(20, 30))))
    assert scheduler_steps(scheduler, 1) == [D0]
    scheduler.release(seq)  # finished (or aborted): nothing decodes, so the whole prompt at once
    assert scheduler_steps(scheduler, 2) == [("prefill", 1, 0, 10), ("decode", 1)]


def test_aborting_a_held_sequence_gives_its_turn_to_the_next() -> None:
    scheduler = _scheduler(every=3)
    _decoding(scheduler)
    held = _seq(1, [5, 5, 5])
    scheduler.add(held)
    scheduler.add(_seq(2, [6, 6, 6]))
    assert scheduler_steps(scheduler, 2) == [D0, D0]
    scheduler.release(held)  # aborted while held: the cadence goes on, 2 takes the slot that was 1's
    assert scheduler_steps(scheduler, 3) == [D0, ("prefill", 2, 0, 3), ("decode", 0, 2)]
    assert not scheduler.waiting


def test_aborting_a_sequence_between_its_chunks_frees_the_slot_for_the_next() -> None:
    scheduler = _scheduler(every=2)
    _decoding(scheduler)
    long = _seq(1, list(range(20, 30)))
    scheduler.add(long)
    scheduler.add(_seq(2, [6, 6, 6]))
    assert scheduler_steps(scheduler, 4) == [D0, D0, ("prefill", 1, 0, 4), D0]
    scheduler.release(long)
    assert scheduler_steps(scheduler, 4) == [D0, ("prefill", 2, 0, 3), ("decode", 0, 2), ("decode", 0, 2)]
    assert scheduler.allocator.num_free == 64 - 3 - 2  # 1's block is back; 0 holds 9 tokens' K/V, 2 holds 5


def test_a_preempted_sequence_is_recomputed_at_the_cadence() -> None:
    """A decode that runs out of blocks preempts the newest sequence; it waits at the front and its
    recompute (prompt and outputs) is one more prefill the cadence holds, not starves."""
    scheduler = _scheduler(every=2, num_blocks=5)
    _decoding(scheduler)
    newest = _seq(1, [4, 4, 4])
    scheduler.add(newest)
    ran = scheduler_steps(scheduler, 8)
    assert ran == [D0, D0, ("prefill", 1, 0, 3), *[("decode", 0, 1)] * 5]
    # 0 has 3 + 7 tokens, 1 has 3 + 6: 3 + 2 blocks of 5; 0's next token needs a third
    assert scheduler_steps(scheduler, 1) == [D0]
    assert newest.num_preemptions == 1 and list(scheduler.waiting) == [newest]
    scheduler.add(_seq(2, [8, 8, 8]))  # behind the preempted one
    assert scheduler_steps(scheduler, 1) == [D0]  # the second decode step since the last prefill
    assert scheduler.release(scheduler.running[0]) is None  # 0 finishes: room, and nothing decodes
    assert scheduler_steps(scheduler, 3) == [("prefill", 1, 0, 9), ("decode", 1), ("decode", 1)]
    assert scheduler_steps(scheduler, 1) == [("prefill", 2, 0, 3)]


def test_n_children_decode_with_their_parent_and_count_as_one_cadence() -> None:
    scheduler = _scheduler(every=2)
    _decoding(scheduler)
    parent = _seq(1, [5, 5, 5, 5], n=3)
    scheduler.add(parent)
    scheduler.add(_seq(2, [6, 6, 6]))
    assert scheduler_steps(scheduler, 3) == [D0, D0, ("prefill", 1, 0, 4)]
    for child_id in (11, 12):  # the engine forks the prefilled parent into its siblings
        child = _seq(child_id, [5, 5, 5, 5])
        child.output_ids = list(parent.output_ids)
        scheduler.fork(parent, child)
    parent.has_forked = True
    assert scheduler_steps(scheduler, 3) == [("decode", 0, 1, 11, 12), ("decode", 0, 1, 11, 12), ("prefill", 2, 0, 3)]


def test_an_image_span_is_chunked_as_without_the_cadence() -> None:
    scheduler = _scheduler(every=2, atomic=True)
    _decoding(scheduler)
    scheduler.add(_seq(1, [1, 2, *[IMG] * 6, 3, 4, 5]))  # the span [2, 8) is longer than the budget of 4
    assert scheduler_steps(scheduler, 9) == [
        D0,
        D0,
        ("prefill", 1, 0, 2),  # would end inside the span: ends at its start
        D0,
        D0,
        ("prefill", 1, 2, 8),  # starts at the span: the span whole
        D0,
        D0,
        ("prefill", 1, 8, 11),
    ]


def test_one_step_ahead_decodes_while_a_prefill_is_held_and_declines_when_it_is_due() -> None:
    scheduler = _scheduler(every=3)
    seq = _decoding(scheduler)
    scheduler.add(_seq(1, [5, 5, 5]))
    assert scheduler_steps(scheduler, 1) == [D0]  # the first of three decode steps
    seq.num_in_flight = 1  # that step's token is still in flight
    for _ in range(2):
        ahead = scheduler.schedule_ahead(lambda s: True)
        assert ahead is not None and ahead.seqs == [seq]
        seq.num_computed = seq.num_tokens  # the in-flight token committed, the next one launched
        seq.output_ids.append(1)
    assert scheduler.schedule_ahead(lambda s: True) is None  # the prefill is due: schedule() decides
    seq.num_in_flight = 0
    seq.num_computed = seq.num_tokens - 1
    assert scheduler_steps(scheduler, 1) == [("prefill", 1, 0, 3)]


def test_the_bound_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="decode_steps_per_prefill"):
        _scheduler(every=0)
