"""A batched prefill whose forward raises for one request's chunk runs its parts apart: that request
fails, every other prompt of the batch (and every decode of a mixed step) goes on with the tokens it
would have had without the faulty neighbour."""

from __future__ import annotations

from typing import Any

import pytest

from sampling.engine import LLMEngine
from sampling.model_runner import ModelRunner
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import add, prompt, run_all

POISON = 31_337  # a token no other prompt here holds


def _poison(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every forward holding ``POISON`` raise; the kinds of forward that raised."""
    raised: list[str] = []
    prefill, prefill_batch = runner.prefill, runner.prefill_batch

    def poisoned_prefill(token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        if POISON in token_ids:
            raised.append("prefill")
            raise RuntimeError("simulated fault of one request")
        return prefill(token_ids, *args, **kwargs)

    def poisoned_batch(chunks: list[Any]) -> Any:
        if any(POISON in c.token_ids for c in chunks):
            raised.append(f"batch of {len(chunks)}")
            raise RuntimeError("simulated fault of one request")
        return prefill_batch(chunks)

    monkeypatch.setattr(runner, "prefill", poisoned_prefill)
    monkeypatch.setattr(runner, "prefill_batch", poisoned_batch)
    return raised


def _requests(engine: LLMEngine, tokenizer: Any, poisoned: bool) -> None:
    for i, text in enumerate(("first prompt", "second", "third prompt here")):
        ids = prompt(tokenizer, text)
        add(engine, f"r{i}", [*ids[:3], POISON, *ids[3:]] if poisoned and i == 1 else ids, max_tokens=6, temperature=0)


def test_one_poisoned_chunk_fails_its_request_alone(
    new_engine: NewEngine, runner: ModelRunner, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = new_engine(max_prefill_seqs=8)
    _requests(clean, hf_tokenizer, poisoned=False)
    expected = run_all(clean)
    raised = _poison(runner, monkeypatch)
    engine = new_engine(max_prefill_seqs=8)
    _requests(engine, hf_tokenizer, poisoned=True)
    outputs = run_all(engine)
    assert raised == ["batch of 3", "prefill"]  # the batch, then the poisoned chunk alone
    assert outputs[("r1", 0)].finish_reason == "error"
    assert "simulated fault of one request" in (outputs[("r1", 0)].error or "")
    for key in (("r0", 0), ("r2", 0)):
        assert outputs[key].finish_reason == "length" and outputs[key].token_ids == expected[key].token_ids


def test_the_decodes_of_a_mixed_step_go_on(
    new_engine: NewEngine, runner: ModelRunner, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running sequence whose decode shares the poisoned prompt's forward decodes alone instead."""
    clean = new_engine(max_prefill_seqs=8)
    add(clean, "running", prompt(hf_tokenizer, "already running"), max_tokens=8, temperature=0)
    expected = run_all(clean)[("running", 0)].token_ids
    raised = _poison(runner, monkeypatch)
    engine = new_engine(max_prefill_seqs=8, mixed_chunk_tokens=256)
    add(engine, "running", prompt(hf_tokenizer, "already running"), max_tokens=8, temperature=0)
    first = engine.step()  # its prefill: it decodes from now on
    add(engine, "bad", [*prompt(hf_tokenizer, "bad")[:3], POISON, 5, 6], max_tokens=4, temperature=0)
    outputs = run_all(engine)
    assert raised == ["batch of 2", "prefill"]  # the running sequence's decode beside the poisoned chunk
    assert outputs[("bad", 0)].finish_reason == "error"
    assert first[0].token_ids + outputs[("running", 0)].token_ids == expected
    assert outputs[("running", 0)].finish_reason == "length"
