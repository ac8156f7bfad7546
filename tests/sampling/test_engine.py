from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.guided import GuidedDecoder
from sampling.model_runner import ModelRunner
from tests.sampling.conftest import NUM_BLOCKS
from tests.sampling.helpers import add, prompt, run_all

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def json_grammar(compiler: xgr.GrammarCompiler) -> xgr.CompiledGrammar:
    return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def test_greedy_output_is_the_same_alone_and_in_a_batch(engine: LLMEngine, hf_tokenizer: Any) -> None:
    target = prompt(hf_tokenizer, "the target prompt")
    add(engine, "alone", target, max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = run_all(engine)[("alone", 0)]
    for i in range(8):  # other lengths, some sampled, some finishing early
        add(
            engine,
            f"other{i}",
            prompt(hf_tokenizer, "x " * (i * 7 + 1)),
            max_tokens=5 + 3 * i,
            temperature=0.7 * (i % 2),
        )
    add(engine, "batched", target, max_tokens=24, temperature=0.0, ignore_eos=True)
    batched = run_all(engine)[("batched", 0)]
    assert batched.token_ids == alone.token_ids and len(alone.token_ids) == 24
    assert batched.text == alone.text


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: LLMEngine, hf_tokenizer: Any) -> None:
    params = {"max_tokens": 20, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 42, "ignore_eos": True}
    target = prompt(hf_tokenizer, "sample me")
    add(engine, "a", target, **params)
    first = run_all(engine)[("a", 0)].token_ids
    add(engine, "b", target, **params)
    for i in range(5):
        add(engine, f"noise{i}", prompt(hf_tokenizer, f"noise {i}"), max_tokens=7, temperature=1.0, seed=i)
    second = run_all(engine)[("b", 0)].token_ids
    add(engine, "c", target, **{**params, "seed": 43})
    other_seed = run_all(engine)[("c", 0)].token_ids
    assert first == second
    assert first != other_seed


def test_n4_guided_sequences_share_one_prefill_and_each_validate(
    engine: LLMEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar
) -> None:
    add(engine, "r", prompt(hf_tokenizer, "four please"), json_grammar, max_tokens=64, temperature=1.0, seed=7, n=4)
    outputs = run_all(engine)
    assert sorted(outputs) == [("r", i) for i in range(4)]
    assert sum(1 for t in engine.timeline if t.kind == "prefill") == 1
    texts = [outputs[("r", i)].text for i in range(4)]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # own generators: not four copies
    assert all(outputs[("r", i)].finish_reason == "stop" for i in range(4))


@pytest.mark.parametrize(
    ("kind", "source", "pattern"),
    [
        ("regex", r"\d{3}-[a-z]{2}", r"\d{3}-[a-z]{2}"),
        ("regex", r"(yes|no|maybe)", r"yes|no|maybe"),
        (
            "grammar",
            'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [a-c] [a-c]?',
            r"\([a-c]{1,2}(,[a-c]{1,2}){0,2}\)",
        ),
    ],
)
def test_regex_choice_and_ebnf_outputs_match(
    engine: LLMEngine, hf_tokenizer: Any, compiler: xgr.GrammarCompiler, kind: str, source: str, pattern: str
) -> None:
    grammar = compiler.compile_regex(source) if kind == "regex" else compiler.compile_grammar(source)
    for seed in range(3):
        add(engine, f"s{seed}", prompt(hf_tokenizer, "go"), grammar, max_tokens=40, temperature=1.0, seed=seed)
    outputs = run_all(engine)
    for out in outputs.values():
        assert out.finish_reason == "stop", out
        assert re.fullmatch(pattern, out.text), out.text


def test_length_stop_strings_and_ignore_eos(engine: LLMEngine, hf_tokenizer: Any) -> None:
    ids = prompt(hf_tokenizer, "tell me")
    add(engine, "long", ids, max_tokens=30, temperature=0.0, ignore_eos=True)
    full = run_all(engine)[("long", 0)]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    add(engine, "stopped", ids, max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,))
    stopped = run_all(engine)[("stopped", 0)]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]


def test_abort_frees_blocks_and_matchers_at_once(
    engine: LLMEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar
) -> None:
    add(engine, "x", prompt(hf_tokenizer, "abort me"), json_grammar, max_tokens=500, n=2, temperature=1.0)
    for _ in range(6):
        engine.step()
    seqs = list(engine._requests["x"].seqs)
    assert engine.scheduler.allocator.num_free < NUM_BLOCKS
    engine.abort("x")
    assert engine.scheduler.allocator.num_free == NUM_BLOCKS
    assert all(s.matcher is None for s in seqs) and not engine.has_work()


def test_rejected_token_fails_only_its_sequence(
    engine: LLMEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = GuidedDecoder.accept
    calls = {"n": 0}

    def reject_first_row_once(matchers: list[Any], tokens: list[int]) -> list[bool]:
        result = real(matchers, tokens)
        calls["n"] += 1
        return [False, *result[1:]] if calls["n"] == 3 else result

    monkeypatch.setattr(GuidedDecoder, "accept", staticmethod(reject_first_row_once))
    for name in ("victim", "bystander"):
        add(engine, name, prompt(hf_tokenizer, name), json_grammar, max_tokens=64, temperature=0.0)
    outputs = run_all(engine)
    failed = [o for o in outputs.values() if o.finish_reason == "error"]
    assert len(failed) == 1 and "rejected by the grammar" in (failed[0].error or "")
    survivor = next(o for o in outputs.values() if o.finish_reason != "error")
    jsonschema.validate(json.loads(survivor.text), SCHEMA)


def test_forward_exception_fails_the_step_and_the_engine_goes_on(
    engine: LLMEngine, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.runner.decode
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(*args)

    monkeypatch.setattr(engine.runner, "decode", flaky)
    add(engine, "a", prompt(hf_tokenizer, "a"), max_tokens=10, temperature=0.0, ignore_eos=True)
    first = run_all(engine)[("a", 0)]
    assert first.finish_reason == "error" and "device lost" in (first.error or "")
    add(engine, "b", prompt(hf_tokenizer, "b"), max_tokens=10, temperature=0.0, ignore_eos=True)
    assert run_all(engine)[("b", 0)].finish_reason == "length"


def test_preemption_recomputes_and_guided_outputs_stay_valid(
    runner: ModelRunner, token_bytes: TokenBytes, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar
) -> None:
    def run(num_blocks: int) -> tuple[dict[str, str], int]:
        engine = LLMEngine(runner, token_bytes, eos_token_ids=[2], num_blocks=num_blocks, max_running=8)
        for i in range(6):
            add(engine, f"g{i}", prompt(hf_tokenizer, f"guided {i} " * 6), json_grammar, max_tokens=60, temperature=0.0)
        seqs = [s for r in engine._requests.values() for s in r.seqs]
        outputs = run_all(engine)
        assert engine.scheduler.allocator.num_free == num_blocks
        return {k[0]: o.text for k, o in outputs.items()}, sum(s.num_preemptions for s in seqs)

    roomy, roomy_preemptions = run(NUM_BLOCKS)
    tight, tight_preemptions = run(12)  # 6 sequences of ~2-3 blocks each cannot all fit
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy  # recompute + matcher replay reproduce the greedy outputs exactly
    for text in tight.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_prompt_that_can_never_fit_fails_cleanly(
    runner: ModelRunner, token_bytes: TokenBytes, hf_tokenizer: Any
) -> None:
    engine = LLMEngine(runner, token_bytes, eos_token_ids=[2], num_blocks=4, max_running=4)
    add(engine, "huge", prompt(hf_tokenizer, "word " * 200), max_tokens=4)
    add(engine, "small", prompt(hf_tokenizer, "hi"), max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = run_all(engine, max_steps=200)
    assert outputs[("huge", 0)].finish_reason == "error"
    assert "KV cache" in (outputs[("huge", 0)].error or "")
    assert outputs[("small", 0)].finish_reason == "length"


def test_lazy_mask_gives_exactly_the_masked_outputs(
    runner: ModelRunner, token_bytes: TokenBytes, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar
) -> None:
    def run(lazy: bool) -> dict[str, list[int]]:
        engine = LLMEngine(runner, token_bytes, eos_token_ids=[2], num_blocks=NUM_BLOCKS, max_running=8)
        engine.lazy_mask = lazy
        for i in range(4):
            add(engine, f"greedy{i}", prompt(hf_tokenizer, f"lazy {i}"), json_grammar, max_tokens=48, temperature=0.0)
        add(engine, "sampled", prompt(hf_tokenizer, "s"), json_grammar, max_tokens=48, temperature=0.9, seed=3)
        return {k[0]: o.token_ids for k, o in run_all(engine).items()}

    assert run(lazy=True) == run(lazy=False)
