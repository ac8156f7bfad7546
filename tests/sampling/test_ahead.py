"""The one-step-ahead loop streams exactly what the synchronous loop streams, chunk for chunk.

Each test drives the same requests through both loops (same arrivals, same aborts at the same step
calls) and compares every output chunk of every sequence: token ids, text deltas, finish reasons, in
order. Outputs are batch-invariant (greedy rows, per-row seeded generators), so the loops may batch
differently (a finished sequence still rides one step ahead) and must still agree.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from sampling.engine import LLMEngine
from sampling.guided.decoder import GuidedDecoder
from sampling.guided.step_grammar import StepGrammar
from sampling.inputs import SeqOutput
from sampling.sequence import SeqState, Sequence
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import SCHEMA, SEEDED, add, prompt, run_all

Chunks = dict[tuple[str, int], list[tuple[list[int], str, str | None, str | None]]]
Action = Callable[[LLMEngine], None]


def drive(engine: LLMEngine, actions: dict[int, Action] | None = None, max_steps: int = 5000) -> Chunks:
    """Step until idle, running ``actions[i]`` before step call ``i``; every sequence's output chunks in order."""
    chunks: Chunks = {}
    actions = dict(actions or {})
    for i in range(max_steps):
        if i in actions:
            actions.pop(i)(engine)
        if not engine.has_work() and not actions:
            return chunks
        for out in engine.step():
            chunks.setdefault((out.request_id, out.index), []).append(
                (out.token_ids, out.text, out.finish_reason, out.error)
            )
    raise AssertionError("the engine did not become idle")


def both(new_engine: NewEngine, run: Callable[[LLMEngine], Chunks], **kwargs: Any) -> tuple[Chunks, LLMEngine]:
    """``run`` on a synchronous engine and on a one-step-ahead one; asserts equal chunks, gives them and
    the one-step-ahead engine (for its counters)."""
    sync = run(new_engine(**kwargs))
    engine = new_engine(one_step_ahead=True, **kwargs)
    ahead = run(engine)
    assert sorted(ahead) == sorted(sync)
    for key, expected in sync.items():
        assert ahead[key] == expected, key
    return sync, engine


def merged(chunks: Chunks, key: tuple[str, int]) -> tuple[list[int], str, str | None]:
    parts = chunks[key]
    return [t for p in parts for t in p[0]], "".join(p[1] for p in parts), parts[-1][2]


def test_mixed_batch_with_late_arrivals_stop_strings_and_chunked_prefill(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    # a stop string from the middle of a greedy output, so that sequence stops on text mid-batch
    reference = new_engine()
    add(reference, "ref", prompt(hf_tokenizer, "tell me"), max_tokens=30, temperature=0.0, ignore_eos=True)
    text = run_all(reference)[("ref", 0)].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0, text

    def late(engine: LLMEngine) -> None:
        add(engine, "late-guided", prompt(hf_tokenizer, "late " * 20), json_grammar, max_tokens=40, temperature=0)
        add(engine, "late-plain", prompt(hf_tokenizer, "late"), max_tokens=9, seed=11, ignore_eos=True, **SEEDED)

    def run(engine: LLMEngine) -> Chunks:
        for i, max_tokens in enumerate((3, 7, 19, 33)):  # finish by length at different steps
            add(engine, f"len{i}", prompt(hf_tokenizer, f"count {i}"), max_tokens=max_tokens, temperature=0)
        add(engine, "stop", prompt(hf_tokenizer, "tell me"), max_tokens=30, temperature=0, stop=(stop,))
        add(engine, "seeded", prompt(hf_tokenizer, "x " * 40), max_tokens=25, seed=3, ignore_eos=True, **SEEDED)
        for i in range(3):  # grammar ends (EOS) at different steps
            add(engine, f"json{i}", prompt(hf_tokenizer, f"json {i}"), json_grammar, max_tokens=48, temperature=0)
        add(engine, "json-n2", prompt(hf_tokenizer, "two"), json_grammar, max_tokens=48, seed=8, n=2, **SEEDED)
        return drive(engine, {6: late})

    chunks, engine = both(new_engine, run, chunk_tokens=16)
    assert engine.ahead is not None and engine.ahead.num_ahead >= 10 and engine.ahead.num_drains >= 3
    assert engine.ahead.num_discarded > 0  # sequences that ended on content rode one more step
    assert merged(chunks, ("stop", 0))[1] == text[: text.index(stop)]
    assert [len(merged(chunks, (f"len{i}", 0))[0]) for i in range(4)] == [3, 7, 19, 33]
    for key in chunks:
        if key[0].startswith(("json", "late-guided")):
            tokens, out, reason = merged(chunks, key)
            assert reason == "stop", (key, out)
            jsonschema.validate(json.loads(out), SCHEMA)


def test_a_token_after_the_end_is_never_accepted_by_a_matcher(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every guided sequence ends with its grammar while its next step is in flight: the matcher
    accepts exactly the streamed tokens, the discarded one never."""
    accepted: dict[int, list[int]] = {}
    owners: dict[int, Sequence] = {}
    real_accept, real_ensure = GuidedDecoder.accept, StepGrammar.ensure_matcher

    def accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
        ok = real_accept(matchers, tokens)
        for matcher, token, good in zip(matchers, tokens, ok, strict=True):
            if good:
                accepted.setdefault(id(matcher), []).append(token)
        return ok

    def ensure(self: StepGrammar, seq: Sequence) -> None:
        real_ensure(self, seq)
        if seq.matcher is not None:
            owners[id(seq.matcher)] = seq  # the sequence keeps its matcher alive while it runs

    monkeypatch.setattr(GuidedDecoder, "accept", staticmethod(accept))
    monkeypatch.setattr(GuidedDecoder, "try_accept", staticmethod(accept))
    monkeypatch.setattr(StepGrammar, "ensure_matcher", ensure)
    engine = new_engine(one_step_ahead=True)
    for i in range(4):
        add(engine, f"g{i}", prompt(hf_tokenizer, f"end {i}"), json_grammar, max_tokens=64, temperature=0)
    add(engine, "s", prompt(hf_tokenizer, "end s"), json_grammar, max_tokens=64, seed=2, **SEEDED)
    outputs = run_all(engine)
    assert engine.ahead is not None and engine.ahead.num_discarded >= len(outputs)
    assert len(owners) == len(outputs) == 5
    for matcher_id, seq in owners.items():
        out = outputs[(seq.request_id, seq.index)]
        assert out.finish_reason == "stop" and seq.state is SeqState.FINISHED
        assert accepted[matcher_id] == out.token_ids, seq.request_id


def test_sequences_ending_by_length_leave_without_an_extra_step(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    """Their last token is known to be the last while it is in flight: no step runs after it."""
    engines: list[LLMEngine] = []

    def run(engine: LLMEngine) -> Chunks:
        engines.append(engine)
        for i in range(6):
            add(engine, f"r{i}", prompt(hf_tokenizer, f"len {i}"), max_tokens=4 + 5 * i, temperature=0, ignore_eos=True)
        return drive(engine)

    both(new_engine, run)
    sync, ahead = engines
    assert ahead.ahead is not None and ahead.ahead.num_discarded == 0 and ahead.ahead.num_ahead > 20
    batches = [[t.batch for t in engine.timeline if t.kind == "decode"] for engine in engines]
    assert batches[1] == batches[0] and batches[0][-1] == 1


@pytest.mark.parametrize("chunk_tokens", [2048, 8])
def test_preemption_and_matcher_replay_give_the_same_outputs(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, chunk_tokens: int
) -> None:
    preemptions: list[int] = []

    def run(engine: LLMEngine) -> Chunks:
        for i in range(4):
            add(engine, f"g{i}", prompt(hf_tokenizer, f"guided {i} " * 6), json_grammar, max_tokens=60, temperature=0)
        add(engine, "seeded", prompt(hf_tokenizer, "seeded"), json_grammar, max_tokens=60, seed=5, **SEEDED)
        for i in range(3):
            ids = prompt(hf_tokenizer, f"plain {i} " * 8)
            add(engine, f"p{i}", ids, max_tokens=70, seed=i, ignore_eos=True, **SEEDED)
        seqs = engine.requests.sequences()
        chunks = drive(engine)
        preemptions.append(sum(s.num_preemptions for s in seqs))
        return chunks

    roomy = run(new_engine(num_blocks=64, max_running=8, chunk_tokens=chunk_tokens))
    tight, _ = both(new_engine, run, num_blocks=12, max_running=8, chunk_tokens=chunk_tokens)
    assert tight == roomy  # the same streams, preempted and recomputed or not
    assert preemptions[0] == 0 and preemptions[1] > 0 and preemptions[2] > 0, preemptions


def test_aborts_in_the_middle_drop_the_token_in_flight(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    in_flight: list[int] = []

    def abort(engine: LLMEngine) -> None:
        seqs = engine.requests["x"].seqs + engine.requests["y"].seqs
        in_flight.extend(s.num_in_flight for s in seqs)
        engine.abort("x")
        engine.abort("y")

    def run(engine: LLMEngine) -> Chunks:
        add(engine, "x", prompt(hf_tokenizer, "abort me"), json_grammar, max_tokens=200, n=2, seed=1, **SEEDED)
        add(engine, "y", prompt(hf_tokenizer, "me too"), max_tokens=200, temperature=0, ignore_eos=True)
        add(engine, "keep", prompt(hf_tokenizer, "keep me"), json_grammar, max_tokens=40, temperature=0)
        add(engine, "plain", prompt(hf_tokenizer, "plain"), max_tokens=30, seed=4, ignore_eos=True, **SEEDED)
        return drive(engine, {12: abort})

    sync = run(new_engine())
    engine = new_engine(one_step_ahead=True)
    ahead = run(engine)
    assert in_flight == [0, 0, 0, 1, 1, 1]  # synchronous: nothing in flight; ahead: one token each
    for key in (("keep", 0), ("plain", 0)):
        assert ahead[key] == sync[key]
    # the aborted sequences streamed a prefix of what they would have written, nothing after the abort
    full = run_all_unaborted(new_engine, hf_tokenizer, json_grammar)
    for key in (("x", 0), ("x", 1), ("y", 0)):
        for chunks in (sync, ahead):
            tokens, _, reason = merged(chunks, key)
            assert reason is None and tokens and full[key][: len(tokens)] == tokens


def run_all_unaborted(new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any) -> dict[tuple[str, int], list[int]]:
    engine = new_engine()
    add(engine, "x", prompt(hf_tokenizer, "abort me"), json_grammar, max_tokens=40, n=2, seed=1, **SEEDED)
    add(engine, "y", prompt(hf_tokenizer, "me too"), max_tokens=40, temperature=0, ignore_eos=True)
    return {k: o.token_ids for k, o in run_all(engine).items()}


def test_outputs_stream_in_step_order(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    """One step's outputs per call, one token per sequence per call, the finish on the last token."""
    engine = new_engine(one_step_ahead=True)
    for i in range(3):
        add(engine, f"r{i}", prompt(hf_tokenizer, f"order {i}"), max_tokens=6 + i, temperature=0, ignore_eos=True)
    calls: list[list[SeqOutput]] = []
    while engine.has_work():
        calls.append(engine.step())
    for call in calls:
        assert len({o.request_id for o in call}) == len(call) and all(len(o.token_ids) == 1 for o in call)
    for i in range(3):
        mine = [o for call in calls for o in call if o.request_id == f"r{i}"]
        assert len(mine) == 6 + i and [o.finish_reason for o in mine] == [None] * (5 + i) + ["length"]
