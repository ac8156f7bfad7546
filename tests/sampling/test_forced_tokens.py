"""Forced tokens: what a grammar admits in one way only is appended after the sampled token and run as
one extend, for both backends; the answer is the same text, written in fewer steps.

Each test runs the same requests with forcing off and on. With greedy sampling the two agree token for
token up to the first place where the model spelt a forced text otherwise than its tokenizer does
(``"`` then ``,`` where the tokenizer writes ``",``): there the forced run writes the tokenizer's
spelling of the same text (``same_until_a_respelling``).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pipeline.bench.forced import respelled_only
from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput
from sampling.params import SamplingParams
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import IMAGE_TOKEN, SCHEMA, SEEDED, prompt, run_all

Outputs = dict[tuple[str, int], SeqOutput]


def add(engine: LLMEngine, request_id: str, ids: list[int], grammar: Any = None, **params: Any) -> None:
    engine.add(EngineInput(request_id, ids, IMAGE_TOKEN, None, SamplingParams(**params), grammar))


def same_until_a_respelling(table: TokenBytes, plain: list[int], forced: list[int]) -> bool:
    """Whether ``forced`` is ``plain`` up to a point where both write the same text in other tokens."""
    return respelled_only(table.table, plain, forced)


def encoder(tokenizer: Any) -> Any:
    """Text to ids, as the engine's factory gives it (xgrammar's forced text is tokenized with it)."""
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture
def forcing(new_engine: NewEngine, hf_tokenizer: Any) -> NewEngine:
    """``forcing(forced=True, ...)``: a fresh engine that forces (or not), with the tokenizer's encoder."""

    def build(forced: bool = True, **overrides: Any) -> LLMEngine:
        return new_engine(forced_tokens=forced, encode=encoder(hf_tokenizer), **overrides)

    return build


def both(
    forcing: NewEngine, requests: list[tuple[str, list[int], Any, dict[str, Any]]], **kw: Any
) -> tuple[Outputs, Outputs, LLMEngine, LLMEngine]:
    """The requests run with forcing off, then on (each on a fresh engine)."""
    runs = []
    for forced in (False, True):
        engine = forcing(forced=forced, **kw)
        for request_id, ids, grammar, params in requests:
            add(engine, request_id, ids, grammar, **params)
        runs.append((run_all(engine), engine))
    (plain, plain_engine), (forced_out, forced_engine) = runs
    return plain, forced_out, plain_engine, forced_engine


def test_a_schema_answer_is_the_same_text_in_fewer_steps(
    forcing: NewEngine, hf_tokenizer: Any, json_grammar: Any, token_bytes: TokenBytes
) -> None:
    requests = [
        (f"r{i}", prompt(hf_tokenizer, f"person {i}"), json_grammar, {"max_tokens": 80, "temperature": 0.0})
        for i in range(4)
    ]
    plain, forced, plain_engine, forced_engine = both(forcing, requests)
    assert forced_engine.parts.num_forced > 0 and plain_engine.parts.num_forced == 0
    assert len(forced_engine.timeline) < len(plain_engine.timeline)
    for key, out in forced.items():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert same_until_a_respelling(token_bytes, plain[key].token_ids, out.token_ids), key


@pytest.mark.parametrize(
    "spec",
    [
        ("regex", r'\{"city": "(Paris|Oslo|Lima)", "days": [1-7]\}'),
        ("choice", ["a long sunny afternoon", "a long rainy evening"]),
    ],
    ids=["regex", "choice"],
)
def test_regex_and_choice_answers_are_forced_where_only_one_way_remains(
    forcing: NewEngine, hf_tokenizer: Any, grammar_compilers: tuple[Any, Any], token_bytes: TokenBytes, spec: Any
) -> None:
    from pipeline.types import GrammarSpec

    kind, value = spec
    for compiler in grammar_compilers:
        grammar = compiler.compile(GrammarSpec(kind, value)).grammar
        requests = [("r", prompt(hf_tokenizer, "go"), grammar, {"max_tokens": 40, "temperature": 0.0})]
        plain, forced, _, forced_engine = both(forcing, requests)
        out = forced[("r", 0)]
        assert forced_engine.parts.num_forced > 0, compiler
        assert out.finish_reason == "stop"
        if kind == "choice":
            assert out.text in value
        else:
            assert json.loads(out.text)["city"] in ("Paris", "Oslo", "Lima")
        assert same_until_a_respelling(token_bytes, plain[("r", 0)].token_ids, out.token_ids)


def test_seeded_siblings_and_a_length_cut_inside_the_forced_text(
    forcing: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    engine = forcing()
    add(engine, "n", prompt(hf_tokenizer, "three"), json_grammar, max_tokens=80, n=3, seed=4, **SEEDED)
    add(engine, "cut", prompt(hf_tokenizer, "cut"), json_grammar, max_tokens=3, temperature=0.0)
    outputs = run_all(engine)
    for i in range(3):
        jsonschema.validate(json.loads(outputs[("n", i)].text), SCHEMA)
    cut = outputs[("cut", 0)]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3  # never more than max_tokens


def test_a_stop_string_inside_the_forced_text_ends_the_answer_there(
    forcing: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    requests = [
        ("s", prompt(hf_tokenizer, "stop"), json_grammar, {"max_tokens": 80, "temperature": 0.0, "stop": ('"n"',)})
    ]
    plain, forced, _, _ = both(forcing, requests)
    assert forced[("s", 0)].finish_reason == plain[("s", 0)].finish_reason == "stop"
    assert forced[("s", 0)].text == plain[("s", 0)].text and '"n"' not in forced[("s", 0)].text


def test_log_probabilities_and_bans_are_sampled_one_token_a_step(
    forcing: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    """A forced token gets no log probability of its own, nor is it banned: such requests are not forced."""
    engine = forcing()
    add(engine, "lp", prompt(hf_tokenizer, "lp"), json_grammar, max_tokens=60, temperature=0.0, logprobs=1)
    add(engine, "ban", prompt(hf_tokenizer, "ban"), json_grammar, max_tokens=60, temperature=0.0, bad_words_ids=((7,),))
    outputs = run_all(engine)
    assert engine.parts.num_forced == 0
    lp = outputs[("lp", 0)]
    assert lp.logprobs is not None and len(lp.logprobs) == len(lp.token_ids)


@pytest.mark.parametrize("chunk_tokens", [2048, 8])
def test_preemption_and_a_prefix_hit_reproduce_the_forced_answers(
    forcing: NewEngine, hf_tokenizer: Any, json_grammar: Any, chunk_tokens: int
) -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int, int]:
        engine = forcing(num_blocks=num_blocks, max_running=8, chunk_tokens=chunk_tokens)
        for i in range(6):
            add(engine, f"g{i}", prompt(hf_tokenizer, f"guided {i} " * 6), json_grammar, max_tokens=60, temperature=0)
        add(engine, "seeded", prompt(hf_tokenizer, "seeded"), json_grammar, max_tokens=60, seed=5, **SEEDED)
        seqs = engine.requests.sequences()
        outputs = run_all(engine)
        for out in outputs.values():
            jsonschema.validate(json.loads(out.text), SCHEMA)
        # again, every prompt in the cache now
        hits = engine.scheduler.allocator.stats.hits
        add(engine, "again", prompt(hf_tokenizer, "guided 0 " * 6), json_grammar, max_tokens=60, temperature=0)
        again = run_all(engine)[("again", 0)]
        assert again.token_ids == outputs[("g0", 0)].token_ids
        tokens = {k[0]: o.token_ids for k, o in outputs.items()}
        return tokens, sum(s.num_preemptions for s in seqs), engine.scheduler.allocator.stats.hits - hits

    roomy, roomy_preemptions, roomy_hits = run(64)
    tight, tight_preemptions, _ = run(7)
    assert roomy_preemptions == 0 and tight_preemptions > 0 and roomy_hits > 0
    assert tight == roomy


def test_one_step_ahead_forces_in_its_synchronous_steps_only(
    forcing: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    engine = forcing(one_step_ahead=True)
    for i in range(3):
        add(engine, f"r{i}", prompt(hf_tokenizer, f"guided {i} " * 3), json_grammar, max_tokens=80, temperature=0.0)
    for out in run_all(engine).values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_dev_corpus_answers_are_the_same_or_respelled(
    forcing: NewEngine, hf_tokenizer: Any, schema_corpus: list[Any], token_bytes: TokenBytes
) -> None:
    """Every fourteenth compiled schema of the dev corpus (the grammar stage's choice of backend), greedy:
    each forced answer is the one-per-step answer, or the same up to a respelling of forced text."""
    entries = [e for e in schema_corpus if e.grammar is not None][::14]
    ids = prompt(hf_tokenizer, "Answer with JSON.")
    requests = [(e.name, ids, e.grammar, {"max_tokens": 64, "temperature": 0.0}) for e in entries]
    plain, forced, _, forced_engine = both(forcing, requests, max_running=len(requests))
    assert forced_engine.parts.num_forced > 0
    differing = [
        key
        for key, out in forced.items()
        if not same_until_a_respelling(token_bytes, plain[key].token_ids, out.token_ids)
    ]
    assert not differing
