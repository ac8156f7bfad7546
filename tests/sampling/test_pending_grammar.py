"""A sequence added while its grammar still compiles (a Future): its prefill runs beside the compile,
its sampling chunk waits for it while other sequences go on decoding, and a compile that fails
fails the sequence unsampled, releasing it."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Any

import pytest

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec
from sampling.guided.decoder import new_matcher
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import SCHEMA, add, prompt, run_all


def _landing_with_the_prefill(engine: Any, monkeypatch: pytest.MonkeyPatch, land: Any) -> list[int]:
    """Call ``land()`` once the engine's first prefill forward has run, before the step learns it has
    (the compile ends during the forward); the lengths of the prefill forwards run, filled as they run."""
    real = engine.runner.prefill
    lengths: list[int] = []

    def prefill(token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(token_ids, *args, **kwargs)
        lengths.append(len(token_ids))
        land()
        return out

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    return lengths


@pytest.mark.parametrize("n", [1, 3])
def test_a_grammar_that_lands_during_the_prefill_constrains_the_first_token_on(
    new_engine: NewEngine,
    hf_tokenizer: Any,
    grammar_compilers: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    n: int,
) -> None:
    spec = GrammarSpec("json_schema", SCHEMA)
    ids = prompt(hf_tokenizer, "pending")
    expected = run_all(_with(new_engine, "known", ids, grammar_compilers[1].compile(spec).grammar, n))
    engine = new_engine()
    pending: Future[Any] = Future()
    forwards = _landing_with_the_prefill(
        engine, monkeypatch, lambda: pending.done() or pending.set_result(grammar_compilers[1].compile(spec).grammar)
    )
    add(engine, "pending", ids, pending, max_tokens=48, temperature=0.0, n=n)
    outputs = run_all(engine)
    assert pending.done()
    assert forwards == [len(ids)]  # one prefill forward, whole: the first token sampled after it
    assert [o.token_ids for o in outputs.values()] == [o.token_ids for o in expected.values()]
    assert all(o.finish_reason == "stop" and o.error is None for o in outputs.values()) and len(outputs) == n


def _with(new_engine: NewEngine, request_id: str, ids: list[int], grammar: Any, n: int) -> Any:
    engine = new_engine()
    add(engine, request_id, ids, grammar, max_tokens=48, temperature=0.0, n=n)
    return engine


def test_a_grammar_that_fails_to_compile_fails_its_sequences_unsampled_and_frees_them(
    new_engine: NewEngine, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = new_engine()
    pending: Future[Any] = Future()
    refusal = GrammarError("the schema admits no value", field="response_format")
    _landing_with_the_prefill(engine, monkeypatch, lambda: pending.done() or pending.set_exception(refusal))
    add(engine, "refused", prompt(hf_tokenizer, "refuse me"), pending, max_tokens=8, temperature=0.0, n=2)
    add(engine, "free", prompt(hf_tokenizer, "free"), max_tokens=8, temperature=0.0)
    outputs = run_all(engine)
    for index in (0, 1):
        refused = outputs[("refused", index)]
        assert refused.finish_reason == "error" and refused.error_kind == "constraint" and not refused.token_ids
        assert "did not compile" in str(refused.error)
    assert outputs[("free", 0)].error is None
    allocator = engine.scheduler.allocator
    assert engine.num_requests == 0 and allocator.num_free == allocator.num_blocks - allocator.stats.blocks_held


def test_an_llguidance_grammar_gives_its_validating_matcher_to_its_first_sequence(
    grammar_compilers: tuple[Any, Any],
) -> None:
    grammar = grammar_compilers[1].compile(GrammarSpec("json_schema", SCHEMA)).grammar
    first, second = new_matcher(grammar), new_matcher(grammar)
    assert first._matcher is grammar.prototype and second._matcher is not grammar.prototype and not grammar.spare
    copy = dataclasses.replace(grammar)  # another grammar (tests change its limits so): its own matchers
    assert not copy.spare and new_matcher(copy)._matcher is not grammar.prototype
    tokens = grammar.tokenizer.tokenize_bytes(b'{"name":"ab","n":1}')
    taken = [first.accept_token(t) for t in tokens]
    assert taken[0] and taken == [second.accept_token(t) for t in tokens]  # the same state, the same answers


@pytest.mark.parametrize("n", [1, 3])
def test_a_compile_that_outlasts_the_prefill_holds_its_own_sequence_and_no_step(
    new_engine: NewEngine,
    hf_tokenizer: Any,
    grammar_compilers: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    n: int,
) -> None:
    """A compile of seconds (xgrammar's, where llguidance refused the spec) must not stall the step
    loop: the other request decodes to its end while the pending one waits, prefilled but for its
    last token, then samples under its grammar exactly as with the grammar known from the start
    (with n > 1, it forks once that token has run)."""
    spec = GrammarSpec("json_schema", SCHEMA)
    grammar = grammar_compilers[1].compile(spec).grammar
    ids = prompt(hf_tokenizer, "pending")
    engine = new_engine()
    expected = run_all(_with(new_engine, "pending", ids, grammar, n))
    forwards = _landing_with_the_prefill(engine, monkeypatch, lambda: None)
    other_ids = prompt(hf_tokenizer, "other")
    pending: Future[Any] = Future()
    # a safety net only: were a step to wait for the compile, it would wait this long, then the
    # assertions below fail (instead of the test hanging)
    guard = threading.Timer(10.0, lambda: pending.done() or pending.set_result(grammar))
    guard.start()
    try:
        add(engine, "pending", ids, pending, max_tokens=48, temperature=0.0, n=n)
        add(engine, "other", other_ids, max_tokens=6, temperature=0.0, ignore_eos=True)
        other: list[int] = []
        for _ in range(50):
            for out in engine.step():
                assert out.request_id == "other"  # nothing of the pending request is sampled
                other += out.token_ids
            if len(other) == 6:
                break
        landed_before = pending.done()
        held = engine.requests["pending"].seqs[0]
        assert (len(other), landed_before) == (6, False)
        assert held.held_for_grammar and held.num_computed == len(ids) - 1 and not held.output_ids
        pending.set_result(grammar)
    finally:
        guard.cancel()
    outputs = run_all(engine)
    for index in range(n):
        assert outputs[("pending", index)].token_ids == expected[("pending", index)].token_ids
        assert outputs[("pending", index)].finish_reason == expected[("pending", index)].finish_reason == "stop"
    # its whole prompt, unsampled; the other's; its last token again, once the compile had ended
    assert forwards == [len(ids), len(other_ids), 1]


@pytest.mark.parametrize("batching", [{"max_prefill_seqs": 4}, {"mixed_chunk_tokens": 64}])
def test_a_failed_compile_in_a_batching_engine_fails_only_its_own_request(
    new_engine: NewEngine, hf_tokenizer: Any, batching: dict[str, int]
) -> None:
    """With prefill batching or mixed steps on, the request whose compile failed still fails alone:
    its sampling chunk shares no forward with another request's chunk or decodes."""
    engine = new_engine(**batching)
    refusal = GrammarError("the schema admits no value", field="response_format")
    failed: Future[Any] = Future()
    failed.set_exception(refusal)
    add(engine, "busy", prompt(hf_tokenizer, "busy"), max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.step()  # its prefill: it decodes from now on
    add(engine, "refused", prompt(hf_tokenizer, "refuse"), failed, max_tokens=8, temperature=0.0)
    add(engine, "free", prompt(hf_tokenizer, "free"), max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = run_all(engine)
    assert outputs[("refused", 0)].error_kind == "constraint" and not outputs[("refused", 0)].token_ids
    # "busy" sampled its first token in the step above
    assert [len(outputs[(other, 0)].token_ids) for other in ("busy", "free")] == [7, 8]
    assert all(outputs[(other, 0)].finish_reason == "length" for other in ("busy", "free"))


def test_a_deferred_last_token_leaves_the_block_it_would_fill_unregistered_until_it_has_run(
    new_engine: NewEngine, hf_tokenizer: Any, grammar_compilers: tuple[Any, Any]
) -> None:
    """A prompt of whole blocks whose compile outlasts its forward: the block its last token fills is
    not offered to prefix hits while that token waits to run again, and the prompt's blocks serve a
    later request with the same prompt, which answers as the first did."""
    grammar = grammar_compilers[1].compile(GrammarSpec("json_schema", SCHEMA)).grammar
    ids = prompt(hf_tokenizer, "a prompt of whole blocks, " * 8)[:48]  # 3 blocks of 16 tokens
    assert len(ids) == 48
    expected = run_all(_with(new_engine, "known", ids, grammar, 1))[("known", 0)]
    engine = new_engine()
    pending: Future[Any] = Future()
    add(engine, "pending", ids, pending, max_tokens=48, temperature=0.0)
    assert engine.step() == []  # the whole prompt's forward; the compile has not ended
    held = engine.requests["pending"].seqs[0]
    assert held.held_for_grammar and held.num_computed == 47 and held.num_registered == 32
    pending.set_result(grammar)
    first = run_all(engine)[("pending", 0)]
    stats = engine.scheduler.allocator.stats
    hits = stats.hits
    add(engine, "again", ids, grammar, max_tokens=48, temperature=0.0)
    again = run_all(engine)[("again", 0)]
    assert first.token_ids == again.token_ids == expected.token_ids and first.finish_reason == "stop"
    assert stats.hits - hits >= 2  # the prompt's blocks, computed once each
