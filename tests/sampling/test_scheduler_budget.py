"""The prefill budget while sequences decode: shorter chunks between decode steps, the full chunk
when nothing decodes, and an image span that must not be split still whole."""

from __future__ import annotations

from typing import Any

from sampling.kv_cache import BlockAllocator
from sampling.params import SamplingParams
from sampling.scheduler import Scheduler
from sampling.sequence import Sequence
from tests.sampling.helpers import scheduler_steps

IMG = 7
BLOCK = 4


def _seq(seq_id: int, prompt: list[int]) -> Sequence:
    # the scheduler reads only the tokens and the block bookkeeping of a sequence
    none: Any = None
    return Sequence(seq_id, f"r{seq_id}", 0, list(prompt), None, SamplingParams(max_tokens=64), None, none, None, none)


def _scheduler(chunk_tokens: int = 16, with_decodes: int | None = 4, atomic: bool = False) -> Scheduler:
    return Scheduler(
        BlockAllocator(64),
        block_size=BLOCK,
        max_running=4,
        chunk_tokens=chunk_tokens,
        chunk_tokens_with_decodes=with_decodes,
        image_token_id=IMG,
        atomic_image_spans=atomic,
    )


def _decoding(scheduler: Scheduler) -> Sequence:
    """A sequence prefilled and decoding, its prefill step and first decode run."""
    seq = _seq(0, [1, 2, 3])
    scheduler.add(seq)
    assert scheduler_steps(scheduler, 1) == [("prefill", 0, 0, 3)]
    return seq


def test_while_a_sequence_decodes_a_prompt_is_prefilled_in_chunks_of_the_budget() -> None:
    scheduler = _scheduler()
    _decoding(scheduler)
    scheduler.add(_seq(1, list(range(20, 30))))  # 10 tokens: one chunk of 16 alone, three of 4 beside a decode
    assert scheduler_steps(scheduler, 7) == [
        ("decode", 0),
        ("prefill", 1, 0, 4),
        ("decode", 0),
        ("prefill", 1, 4, 8),
        ("decode", 0),
        ("prefill", 1, 8, 10),
        ("decode", 0, 1),
    ]


def test_with_nothing_decoding_a_prompt_takes_the_full_chunk() -> None:
    scheduler = _scheduler()
    scheduler.add(_seq(1, list(range(20, 30))))
    scheduler.add(_seq(2, list(range(20, 40))))  # 20 tokens: the first decodes by its second chunk
    assert scheduler_steps(scheduler, 5) == [
        ("prefill", 1, 0, 10),
        ("decode", 1),
        ("prefill", 2, 0, 4),
        ("decode", 1),
        ("prefill", 2, 4, 8),
    ]


def test_without_a_budget_the_chunk_is_the_same_while_decoding() -> None:
    scheduler = _scheduler(with_decodes=None)
    _decoding(scheduler)
    scheduler.add(_seq(1, list(range(20, 50))))
    assert scheduler_steps(scheduler, 4) == [
        ("decode", 0),
        ("prefill", 1, 0, 16),
        ("decode", 0),
        ("prefill", 1, 16, 30),
    ]


def test_a_budget_over_the_chunk_is_the_chunk() -> None:
    scheduler = _scheduler(chunk_tokens=4, with_decodes=16)
    _decoding(scheduler)
    scheduler.add(_seq(1, list(range(20, 30))))
    assert scheduler_steps(scheduler, 4) == [("decode", 0), ("prefill", 1, 0, 4), ("decode", 0), ("prefill", 1, 4, 8)]


def test_an_image_span_longer_than_the_budget_goes_whole_in_its_own_chunk() -> None:
    scheduler = _scheduler(atomic=True)
    _decoding(scheduler)
    scheduler.add(_seq(1, [1, 2, *[IMG] * 6, 3, 4, 5]))  # the span [2, 8) is longer than the budget of 4
    assert scheduler_steps(scheduler, 6) == [
        ("decode", 0),
        ("prefill", 1, 0, 2),  # would end inside the span: ends at its start
        ("decode", 0),
        ("prefill", 1, 2, 8),  # starts at the span: the span whole
        ("decode", 0),
        ("prefill", 1, 8, 11),
    ]
