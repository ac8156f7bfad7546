"""The engine core: batch invariance, seeded sampling, n > 1, finish reasons, abort, faults, preemption."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import llguidance
import pytest
import torch
import xgrammar as xgr

from pipeline.types import GrammarSpec
from sampling.engine import LLMEngine
from sampling.guided.decoder import GuidedDecoder
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import SCHEMA, SEEDED, add, prompt, run_all


def _add_crowd(engine: LLMEngine, tokenizer: Any, grammar: xgr.CompiledGrammar) -> None:
    """Eight other requests: prompt lengths 8-400 tokens, greedy and sampled, one n=2, one guided."""
    for i in range(8):
        params: dict[str, Any] = {"max_tokens": 5 + 4 * i, "temperature": 0.7 * (i % 2), "seed": i}
        if i == 3:
            params["n"] = 2
        add(engine, f"other{i}", prompt(tokenizer, "x " * (i * i * 6 + 1)), grammar if i == 5 else None, **params)


def test_greedy_output_is_the_same_alone_and_in_a_batch(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar
) -> None:
    target = prompt(hf_tokenizer, "the target prompt")
    engine = new_engine()
    add(engine, "alone", target, max_tokens=32, temperature=0.0, ignore_eos=True)
    alone = run_all(engine)[("alone", 0)]
    engine = new_engine(chunk_tokens=64)  # the long prompts of the crowd prefill in chunks between decodes
    _add_crowd(engine, hf_tokenizer, json_grammar)
    add(engine, "batched", target, max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = run_all(engine)
    batched = outputs[("batched", 0)]
    assert len(outputs) == 10 and all(o.finish_reason in ("stop", "length") for o in outputs.values())
    assert max(t.batch for t in engine.timeline) >= 5  # it really ran beside the others
    assert len(alone.token_ids) == 32
    assert batched.token_ids == alone.token_ids
    assert batched.text == alone.text


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar, one_step_ahead: bool
) -> None:
    params = {"max_tokens": 24, "seed": 42, "ignore_eos": True, **SEEDED}
    target = prompt(hf_tokenizer, "sample me")
    engine = new_engine(one_step_ahead=one_step_ahead)
    add(engine, "a", target, **params)
    first = run_all(engine)[("a", 0)].token_ids
    engine = new_engine(one_step_ahead=one_step_ahead)
    _add_crowd(engine, hf_tokenizer, json_grammar)
    add(engine, "b", target, **params)
    add(engine, "c", target, **{**params, "seed": 43})
    outputs = run_all(engine)
    assert outputs[("b", 0)].token_ids == first and len(first) == 24
    assert outputs[("c", 0)].token_ids != first  # the seed matters


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_n4_shares_one_prefill_and_gives_four_outputs(
    new_engine: NewEngine, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, one_step_ahead: bool
) -> None:
    engine = new_engine(one_step_ahead=one_step_ahead)
    prefills: list[int] = []
    real = engine.runner.prefill

    def counted(token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        prefills.append(len(token_ids))
        return real(token_ids, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "prefill", counted)
    ids = prompt(hf_tokenizer, "four please")
    add(engine, "r", ids, max_tokens=12, temperature=1.0, seed=7, n=4, ignore_eos=True)
    outputs = run_all(engine)
    assert prefills == [len(ids)]
    assert sum(1 for t in engine.timeline if t.kind == "prefill") == 1
    assert sorted(outputs) == [("r", i) for i in range(4)]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outputs.values())
    assert len({tuple(o.token_ids) for o in outputs.values()}) == 4  # own generators: not four copies


def test_max_tokens_gives_length_and_stop_strings_cut_the_text(engine: LLMEngine, hf_tokenizer: Any) -> None:
    ids = prompt(hf_tokenizer, "tell me")
    add(engine, "long", ids, max_tokens=30, temperature=0.0, ignore_eos=True)
    full = run_all(engine)[("long", 0)]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    middle = len(full.text) // 2
    stop = full.text[middle : middle + 3]
    assert stop.strip() and full.text.index(stop) > 0, full.text
    add(engine, "stopped", ids, max_tokens=30, temperature=0.0, ignore_eos=True, stop=("never written", stop))
    stopped = run_all(engine)[("stopped", 0)]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert len(stopped.token_ids) < 30


def test_eos_stops_unless_ignore_eos(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    ids = prompt(hf_tokenizer, "end somewhere")
    engine = new_engine()
    add(engine, "free", ids, max_tokens=16, temperature=0.0)
    tokens = run_all(engine)[("free", 0)].token_ids
    # call a token the model writes greedily "EOS", at its first occurrence after a few tokens
    cut = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])
    engine = new_engine(eos_token_ids=[tokens[cut]])
    add(engine, "eos", ids, max_tokens=16, temperature=0.0)
    add(engine, "ignore", ids, max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = run_all(engine)
    assert outputs[("eos", 0)].finish_reason == "stop"
    assert outputs[("eos", 0)].token_ids == tokens[: cut + 1]
    ignored = outputs[("ignore", 0)]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 16
    assert ignored.token_ids[:cut] == tokens[:cut] and tokens[cut] not in ignored.token_ids


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_abort_frees_the_slot_blocks_and_matchers_at_once(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar, one_step_ahead: bool
) -> None:
    engine = new_engine(one_step_ahead=one_step_ahead)
    add(engine, "x", prompt(hf_tokenizer, "abort me"), json_grammar, max_tokens=500, n=2, temperature=1.0)
    add(engine, "keep", prompt(hf_tokenizer, "keep me"), max_tokens=20, temperature=0.0, ignore_eos=True)
    for _ in range(6):
        engine.step()
    seqs = list(engine.requests["x"].seqs)
    assert len(seqs) == 2 and all(s.block_table and s.matcher is not None for s in seqs)
    held = sum(len(s.block_table) for s in seqs)
    free_before = engine.scheduler.allocator.num_free
    engine.abort("x")
    assert engine.scheduler.allocator.num_free == free_before + held
    assert all(s.matcher is None and not s.block_table for s in seqs)
    assert not any(s in engine.scheduler.running for s in seqs) and "x" not in engine.requests
    add(engine, "waiting", prompt(hf_tokenizer, "never runs"), max_tokens=5)
    engine.abort("waiting")  # aborted before it was ever scheduled
    outputs = run_all(engine)
    assert set(outputs) == {("keep", 0)} and outputs[("keep", 0)].finish_reason == "length"


def test_a_prompt_longer_than_the_cache_fails_cleanly(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    engine = new_engine(num_blocks=4)  # 64 tokens
    add(engine, "huge", prompt(hf_tokenizer, "word " * 200), max_tokens=4)
    add(engine, "huge-n", prompt(hf_tokenizer, "word " * 12), max_tokens=4, n=4)  # fits once, not four times
    add(engine, "small", prompt(hf_tokenizer, "hi"), max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = run_all(engine, max_steps=200)
    for key in [("huge", 0), *(("huge-n", i) for i in range(4))]:
        assert outputs[key].finish_reason == "error" and "KV cache" in (outputs[key].error or ""), key
    assert outputs[("small", 0)].finish_reason == "length"


def test_a_sequence_that_outgrows_the_cache_fails_and_the_rest_finish(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    engine = new_engine(num_blocks=3)  # 48 tokens: the first request fits, then cannot grow any further
    add(engine, "grows", prompt(hf_tokenizer, "grow"), max_tokens=100, temperature=0.0, ignore_eos=True)
    add(engine, "after", prompt(hf_tokenizer, "hi"), max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = run_all(engine, max_steps=500)
    assert outputs[("grows", 0)].finish_reason == "error" and "KV cache" in (outputs[("grows", 0)].error or "")
    assert outputs[("after", 0)].finish_reason == "length"


@pytest.mark.parametrize("chunk_tokens", [2048, 8])
def test_preemption_recomputes_and_outputs_stay_valid_and_equal(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar, chunk_tokens: int
) -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], dict[str, str], int]:
        engine = new_engine(num_blocks=num_blocks, max_running=8, chunk_tokens=chunk_tokens)
        for i in range(6):
            add(engine, f"g{i}", prompt(hf_tokenizer, f"guided {i} " * 6), json_grammar, max_tokens=60, temperature=0)
        add(engine, "seeded", prompt(hf_tokenizer, "seeded"), json_grammar, max_tokens=60, seed=5, **SEEDED)
        add(engine, "plain", prompt(hf_tokenizer, "plain " * 8), max_tokens=50, temperature=0.0, ignore_eos=True)
        seqs = engine.requests.sequences()
        outputs = run_all(engine)
        assert all(o.finish_reason in ("stop", "length") for o in outputs.values()), outputs
        tokens = {k[0]: o.token_ids for k, o in outputs.items()}
        return tokens, {k[0]: o.text for k, o in outputs.items()}, sum(s.num_preemptions for s in seqs)

    roomy_tokens, _, roomy_preemptions = run(64)
    tight_tokens, tight_texts, tight_preemptions = run(9)  # 8 sequences of 2-5 blocks each cannot all fit
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight_tokens == roomy_tokens  # recompute + matcher replay reproduce greedy and seeded outputs
    for name, text in tight_texts.items():
        if name != "plain":
            jsonschema.validate(json.loads(text), SCHEMA)


# n = 3 children share their parent's full prompt block, so they fit in fewer blocks than copies did
@pytest.mark.parametrize(("prompt_len", "n", "tight_blocks"), [(90, 1, 8), (20, 3, 6)])
def test_a_prefill_whose_room_growing_decodes_took_is_preempted_not_crashed(
    new_engine: NewEngine, prompt_len: int, n: int, tight_blocks: int
) -> None:
    """Admission checks the free blocks once; decodes that grow during a chunked prefill (or before the
    fork of an n > 1 request) may take them. The scheduler must preempt, not ask the allocator for
    blocks it does not have (that raised MemoryError out of ``step()``, or failed the request)."""

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        engine = new_engine(num_blocks=num_blocks, chunk_tokens=8)
        add(engine, "grows", list(range(100, 100 + 30)), max_tokens=60, temperature=0.0, ignore_eos=True)
        early = engine.step() + engine.step() + engine.step() + engine.step()
        add(engine, "late", list(range(300, 300 + prompt_len)), max_tokens=5, temperature=1.0, seed=1, n=n)
        seqs = engine.requests.sequences()
        outputs = run_all(engine)
        assert all(o.finish_reason == "length" for o in outputs.values()), outputs
        tokens = {f"{k[0]}{k[1]}": o.token_ids for k, o in outputs.items()}
        tokens["grows0"] = [t for o in early for t in o.token_ids] + tokens["grows0"]
        return tokens, sum(s.num_preemptions for s in seqs)

    roomy, roomy_preemptions = run(64)
    tight, tight_preemptions = run(tight_blocks)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy and len(tight["grows0"]) == 60 and len(tight) == 1 + n


def test_a_preempted_parent_of_n_children_is_readmitted_alone(new_engine: NewEngine) -> None:
    """Once forked, a parent holds one copy of its blocks: readmitting it after a preemption must not
    ask room for n copies (with 81 tokens that was 12 of 10 blocks, and it failed as 'never fits')."""

    def run(num_blocks: int) -> tuple[dict[tuple[str, int], list[int]], int]:
        engine = new_engine(num_blocks=num_blocks)
        add(engine, "old", list(range(100, 108)), max_tokens=100, temperature=0.0, ignore_eos=True)
        add(engine, "pair", list(range(200, 208)), max_tokens=100, temperature=1.0, seed=3, n=2, ignore_eos=True)
        parent = engine.requests["pair"].seqs[0]
        outputs = run_all(engine)
        assert all(o.finish_reason == "length" for o in outputs.values()), outputs
        return {k: o.token_ids for k, o in outputs.items()}, parent.num_preemptions

    roomy, roomy_preemptions = run(64)
    tight, tight_preemptions = run(10)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy and len(tight) == 3


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_a_rejected_token_fails_only_its_sequence(
    new_engine: NewEngine,
    hf_tokenizer: Any,
    json_grammar: xgr.CompiledGrammar,
    monkeypatch: pytest.MonkeyPatch,
    one_step_ahead: bool,
) -> None:
    engine = new_engine(one_step_ahead=one_step_ahead)
    real = GuidedDecoder.accept
    calls = {"n": 0}

    def reject_first_row_once(matchers: list[Any], tokens: list[int]) -> list[bool]:
        result = real(matchers, tokens)
        calls["n"] += 1
        return [False, *result[1:]] if calls["n"] == 3 else result

    monkeypatch.setattr(GuidedDecoder, "accept", staticmethod(reject_first_row_once))
    for name in ("victim", "bystander", "guided"):
        add(engine, name, prompt(hf_tokenizer, name), json_grammar, max_tokens=64, temperature=0.0)
    add(engine, "plain", prompt(hf_tokenizer, "plain"), max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = run_all(engine)
    failed = [o for o in outputs.values() if o.finish_reason == "error"]
    assert len(failed) == 1 and "rejected by the grammar" in (failed[0].error or "")
    assert outputs[("plain", 0)].finish_reason == "length"
    for out in outputs.values():
        if out.finish_reason != "error" and out.request_id != "plain":
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_an_exception_in_decode_fails_that_step_and_the_engine_goes_on(
    new_engine: NewEngine,
    hf_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
    json_grammar: xgr.CompiledGrammar,
    one_step_ahead: bool,
) -> None:
    engine = new_engine(one_step_ahead=one_step_ahead)
    real = engine.runner.decode
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(*args)

    monkeypatch.setattr(engine.runner, "decode", flaky)
    add(engine, "a", prompt(hf_tokenizer, "a"), max_tokens=10, temperature=0.0, ignore_eos=True)
    add(engine, "b", prompt(hf_tokenizer, "b"), json_grammar, max_tokens=40, temperature=0.0, n=2)
    first = run_all(engine)
    assert len(first) == 3
    assert all(o.finish_reason == "error" and "device lost" in (o.error or "") for o in first.values())
    add(engine, "c", prompt(hf_tokenizer, "c"), max_tokens=10, temperature=0.0, ignore_eos=True)
    add(engine, "d", prompt(hf_tokenizer, "d"), json_grammar, max_tokens=40, temperature=0.0)
    second = run_all(engine)
    assert second[("c", 0)].finish_reason == "length"
    assert second[("d", 0)].finish_reason == "stop"
    jsonschema.validate(json.loads(second[("d", 0)].text), SCHEMA)


def test_lazy_mask_gives_exactly_the_masked_outputs(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar
) -> None:
    def run(lazy: bool) -> dict[str, list[int]]:
        engine = new_engine(max_running=8, lazy_mask=lazy)
        for i in range(4):
            add(engine, f"greedy{i}", prompt(hf_tokenizer, f"lazy {i}"), json_grammar, max_tokens=48, temperature=0)
        add(engine, "sampled", prompt(hf_tokenizer, "s"), json_grammar, max_tokens=48, seed=3, **SEEDED)
        return {k[0]: o.token_ids for k, o in run_all(engine).items()}

    assert run(lazy=True) == run(lazy=False)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, SEEDED | {"seed": 1}], ids=["greedy", "seeded"])
def test_a_long_llguidance_choice_list_is_followed(
    new_engine: NewEngine, hf_tokenizer: Any, grammar_compilers: tuple[Any, Any], params: dict[str, Any]
) -> None:
    # 2,000 choices overflowed llguidance's parser row on the first token: "token 1099 was rejected"
    choices = [f"c{i * 7919 % 100_003}-{i}" for i in range(2_000)]
    grammar = grammar_compilers[1].compile(GrammarSpec("choice", choices)).grammar
    engine = new_engine()
    add(engine, "choice", prompt(hf_tokenizer, "pick one"), grammar, max_tokens=32, **params)
    out = run_all(engine)[("choice", 0)]
    assert out.error is None and out.finish_reason == "stop" and out.text in choices


def test_a_matcher_that_gives_up_fails_its_constraint_not_the_engine(
    new_engine: NewEngine, hf_tokenizer: Any, grammar_compilers: tuple[Any, Any]
) -> None:
    # a parser cap the grammar outgrows on its first token (the mask allowed it): the client's error
    grammar = grammar_compilers[1].backend.compile_lark("start: " + " | ".join(f'"x{i}"' for i in range(20)))
    grammar = dataclasses.replace(grammar, limits=llguidance.LLParserLimits(max_items_in_row=10))
    engine = new_engine()
    add(engine, "capped", prompt(hf_tokenizer, "x"), grammar, max_tokens=8, temperature=0.0)
    add(engine, "free", prompt(hf_tokenizer, "x"), max_tokens=8, temperature=0.0)
    outputs = run_all(engine)
    capped = outputs[("capped", 0)]
    assert capped.finish_reason == "error" and capped.error_kind == "constraint"
    assert "cannot follow this constraint" in str(capped.error) and "max is 10" in str(capped.error)
    assert outputs[("free", 0)].error is None


def test_unseeded_sequences_draw_their_own_seeds_and_leave_torch_s_generator_alone(
    new_engine: NewEngine, hf_tokenizer: Any
) -> None:
    engine = new_engine()
    state = torch.get_rng_state()
    target = prompt(hf_tokenizer, "sample me")
    add(engine, "u", target, max_tokens=16, ignore_eos=True, n=2, **SEEDED)
    add(engine, "v", target, max_tokens=16, ignore_eos=True, **SEEDED)
    assert torch.equal(torch.get_rng_state(), state)  # an unseeded request does not reseed the process
    outputs = run_all(engine)
    drawn = {tuple(outputs[key].token_ids) for key in [("u", 0), ("u", 1), ("v", 0)]}
    assert len(drawn) == 3  # each sequence its own seed: the same prompt, three different answers
