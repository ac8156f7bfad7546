"""Prefill chunks of several sequences in one step (``max_prefill_seqs``) leave every answer as it is
with one sequence a step: greedy and seeded, guided, n > 1, prefix-cache hits, preemption replays,
one step ahead."""

from __future__ import annotations

from typing import Any

import pytest

from sampling.engine import LLMEngine
from sampling.scheduler import PrefillBatch
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import SEEDED, add, run_all

SHARED = list(range(300, 340))  # 40 tokens: two and a half blocks every prompt starts with


def _count_batches(engine: LLMEngine) -> list[tuple[int, int]]:
    """The chunks and decodes of each ``PrefillBatch`` the engine runs, kept as it schedules."""
    sizes: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def counted() -> Any:
        decided = schedule()
        if isinstance(decided.step, PrefillBatch):
            sizes.append((len(decided.step.chunks), len(decided.step.decodes)))
        return decided

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    return sizes


def _answers(
    new_engine: NewEngine, max_prefill_seqs: int, json_grammar: Any, **overrides: Any
) -> tuple[dict[Any, list[int]], list[tuple[int, int]], int]:
    engine = new_engine(
        max_prefill_seqs=max_prefill_seqs, **({"chunk_tokens": 48, "chunk_tokens_with_decodes": 24} | overrides)
    )
    sizes = _count_batches(engine)
    add(engine, "long", SHARED + list(range(500, 530)), max_tokens=12, temperature=0.0, ignore_eos=True)
    for _ in range(3):  # the first request decodes while the others arrive
        engine.step()
    for i in range(6):
        params: dict[str, Any] = {"max_tokens": 10, "ignore_eos": True, "temperature": 0.0}
        if i == 1:
            params = {**SEEDED, "seed": 7, "max_tokens": 10, "ignore_eos": True}
        if i == 2:
            params["n"] = 2
        grammar = json_grammar if i == 3 else None
        add(engine, f"r{i}", [*SHARED, 600 + i, 700 + i, 800 + i], grammar, **params)
    outputs = run_all(engine)
    seqs_preempted = engine.scheduler.num_preemptions
    return {k: o.token_ids for k, o in outputs.items()}, sizes, seqs_preempted


@pytest.mark.parametrize("mixed", [0, 24], ids=["prefills", "with-decodes"])
@pytest.mark.parametrize("one_step_ahead", [False, True])
def test_batched_prefills_give_the_answers_of_one_prefill_a_step(
    new_engine: NewEngine, json_grammar: Any, one_step_ahead: bool, mixed: int
) -> None:
    """With ``mixed``, the running decodes share the short chunks' forward too (a mixed step)."""
    alone, no_batches, _ = _answers(new_engine, 1, json_grammar, one_step_ahead=one_step_ahead)
    batched, sizes, _ = _answers(new_engine, 16, json_grammar, one_step_ahead=one_step_ahead, mixed_chunk_tokens=mixed)
    assert not no_batches and max(c for c, _ in sizes) >= 3  # prefix-cache hits of 3 tokens share steps
    assert any(d for _, d in sizes) == bool(mixed)
    assert batched == alone
    assert len(batched) == 8 and all(batched.values())  # r2 answers twice (n = 2)


def test_batched_prefills_replay_preempted_sequences_exactly(new_engine: NewEngine, json_grammar: Any) -> None:
    """A cache too small for all of them: sequences are preempted and replayed, some in batches
    (whole prompts of 43 tokens and more share a step: no prefix cache, a budget of 96)."""
    small = {"num_blocks": 12, "prefix_caching": False, "chunk_tokens_with_decodes": 96, "chunk_tokens": 96}
    small["mixed_chunk_tokens"] = 96
    alone, _, preempted_alone = _answers(new_engine, 1, json_grammar, **small)
    batched, sizes, preempted = _answers(new_engine, 16, json_grammar, **small)
    assert preempted and preempted_alone and any(c > 1 for c, _ in sizes) and any(d for _, d in sizes)
    assert batched == alone
