"""vLLM's extra sampling fields in the engine: stop_token_ids, min_tokens, include_stop_str_in_output,
bad_words_ids and allowed_token_ids, against transformers' ``generate`` where it has the same field;
under a grammar (the constraint wins); and alike in both loops, with n > 1 and after preemption."""

from __future__ import annotations

import json
import string
from typing import Any

import jsonschema
import pytest
import torch

from sampling.engine import LLMEngine
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import EOS, SCHEMA, SEEDED, add, prompt, run_all

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16}


def _generate(reference: Any, ids: list[int], **kwargs: Any) -> list[int]:
    """transformers' greedy continuation of ``ids``."""
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


def _first_new(tokens: list[int], start: int) -> int:
    """The index of the first token from ``start`` on that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture
def base(new_engine: NewEngine, hf_tokenizer: Any) -> tuple[list[int], list[int]]:
    """A prompt and its greedy answer of 16 tokens without EOS."""
    ids = prompt(hf_tokenizer, "tell me about the fox")
    engine = new_engine()
    add(engine, "base", ids, ignore_eos=True, **GREEDY)
    return ids, run_all(engine)[("base", 0)].token_ids


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_a_stop_token_ends_the_sequence_without_its_text(
    new_engine: NewEngine, hf_tokenizer: Any, base: tuple[list[int], list[int]], include: bool
) -> None:
    ids, tokens = base
    cut = _first_new(tokens, 4)
    engine = new_engine()
    add(engine, "s", ids, stop_token_ids=(tokens[cut], 99_999), include_stop_str_in_output=include, **GREEDY)
    out = run_all(engine)[("s", 0)]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: cut + 1]
    assert out.text == hf_tokenizer.decode(tokens[: cut + 1 if include else cut])


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_min_tokens_delays_eos_and_stop_tokens_as_generate_does(
    new_engine: NewEngine, reference: Any, base: tuple[list[int], list[int]], one_step_ahead: bool
) -> None:
    """A bias makes EOS (or a stop token) the greedy choice at every step: without min_tokens the
    answer is that one token; with it, the end comes after min_tokens tokens, as ``min_new_tokens``."""
    ids, tokens = base
    stop = tokens[_first_new(tokens, 2)]
    engine = new_engine(one_step_ahead=one_step_ahead)
    eos_bias = ((EOS[0], 100.0),)
    add(engine, "eos", ids, logit_bias=eos_bias, min_tokens=5, **GREEDY)
    add(engine, "eos-now", ids, logit_bias=eos_bias, **GREEDY)
    add(engine, "stop", ids, logit_bias=((stop, 100.0),), stop_token_ids=(stop,), min_tokens=3, **GREEDY)
    outputs = run_all(engine)
    expected_eos = _generate(reference, ids, max_new_tokens=16, min_new_tokens=5, sequence_bias={(EOS[0],): 100.0})
    expected_stop = _generate(
        reference, ids, max_new_tokens=16, min_new_tokens=3, eos_token_id=[*EOS, stop], sequence_bias={(stop,): 100.0}
    )
    assert outputs[("eos-now", 0)].token_ids == EOS
    assert outputs[("eos", 0)].token_ids == expected_eos and len(expected_eos) == 6
    assert outputs[("stop", 0)].token_ids == expected_stop and expected_stop[-1] == stop and len(expected_stop) == 4
    assert all(outputs[(k, 0)].finish_reason == "stop" for k in ("eos", "stop"))


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_stop_strings_wait_for_min_tokens_and_may_stay_in_the_text(
    new_engine: NewEngine, hf_tokenizer: Any, base: tuple[list[int], list[int]], include: bool
) -> None:
    """A stop string that ends in the text of the first min_tokens tokens does not count (vLLM): the
    answer goes on to a later one, or to max_tokens."""
    ids, tokens = base
    text = hf_tokenizer.decode(tokens)
    early = hf_tokenizer.decode(tokens[:2])
    stop = early[-2:]  # ends in the text of the second token
    assert stop.strip(), text
    engine = new_engine()
    add(engine, "now", ids, stop=(stop,), include_stop_str_in_output=include, ignore_eos=True, **GREEDY)
    add(engine, "later", ids, stop=(stop,), include_stop_str_in_output=include, ignore_eos=True, min_tokens=4, **GREEDY)
    outputs = run_all(engine)

    def cut(after: int) -> str:
        """The text cut at the first stop string that ends past ``after`` characters."""
        index = text.find(stop, max(0, after - len(stop) + 1))
        return text if index < 0 else text[: index + len(stop) if include else index]

    assert outputs[("now", 0)].text == cut(0) and outputs[("now", 0)].finish_reason == "stop"
    later = outputs[("later", 0)]
    assert later.text == cut(len(hf_tokenizer.decode(tokens[:4])))
    assert later.finish_reason == ("length" if later.text == text else "stop")


def test_include_streams_the_text_as_it_comes(
    new_engine: NewEngine, hf_tokenizer: Any, base: tuple[list[int], list[int]]
) -> None:
    """Without include, the text that may begin a stop string waits for the next token; with it,
    every token's text leaves with the token, as without stop strings."""
    ids, tokens = base
    stop = "never written, but long enough to hold text back"
    engine = new_engine()
    add(engine, "cut", ids, stop=(stop,), ignore_eos=True, **GREEDY)
    add(engine, "kept", ids, stop=(stop,), include_stop_str_in_output=True, ignore_eos=True, **GREEDY)
    add(engine, "plain", ids, ignore_eos=True, **GREEDY)
    chunks: dict[str, list[str]] = {"cut": [], "kept": [], "plain": []}
    while engine.has_work():
        for out in engine.step():
            chunks[out.request_id].append(out.text)
    assert "".join(chunks["kept"]) == "".join(chunks["cut"]) == hf_tokenizer.decode(tokens)
    assert chunks["kept"] == chunks["plain"] != chunks["cut"]
    assert chunks["cut"][0] == "" != chunks["plain"][0]


def test_bad_words_are_never_written_as_generate_bans_them(
    new_engine: NewEngine, reference: Any, base: tuple[list[int], list[int]]
) -> None:
    ids, tokens = base
    words = ((tokens[0],), (tokens[2], tokens[3]))  # the first token; the fourth after the third
    engine = new_engine()
    add(engine, "one", ids, bad_words_ids=words[:1], ignore_eos=True, **GREEDY)
    add(engine, "two", ids, bad_words_ids=words[1:], ignore_eos=True, **GREEDY)
    outputs = run_all(engine)
    one = _generate(reference, ids, max_new_tokens=16, bad_words_ids=[list(words[0])], suppress_tokens=EOS)
    two = _generate(reference, ids, max_new_tokens=16, bad_words_ids=[list(words[1])], suppress_tokens=EOS)
    assert outputs[("one", 0)].token_ids == one and tokens[0] not in one
    assert outputs[("two", 0)].token_ids == two and two[:3] == tokens[:3] and two[3] != tokens[3]


def test_allowed_token_ids_under_a_grammar(new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any) -> None:
    """Allowed: the tokens of one valid answer, the single characters any answer can be spelt with,
    and EOS. Greedy and sampled, the answer is valid and written with those tokens alone."""
    chars = string.ascii_lowercase + string.digits + '{}":, '
    allowed = (
        *hf_tokenizer.encode('{"name": "abc", "n": 42}', add_special_tokens=False),
        *hf_tokenizer.convert_tokens_to_ids(list(chars)),
        *EOS,
    )
    engine = new_engine()
    ids = prompt(hf_tokenizer, "json")
    add(engine, "greedy", ids, json_grammar, max_tokens=40, temperature=0.0, allowed_token_ids=allowed)
    add(engine, "seeded", ids, json_grammar, max_tokens=40, seed=4, allowed_token_ids=allowed, **SEEDED)
    add(engine, "free", ids, json_grammar, max_tokens=40, temperature=0.0)
    outputs = run_all(engine)
    assert not set(outputs[("free", 0)].token_ids) <= set(allowed)  # the ids change the answer
    for key in ("greedy", "seeded"):
        out = outputs[(key, 0)]
        assert out.finish_reason == "stop" and set(out.token_ids) <= set(allowed), key
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_a_grammar_that_ends_before_min_tokens_still_ends(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, one_step_ahead: bool
) -> None:
    """A finished grammar allows EOS alone; min_tokens forbids it: the constraint wins, and the
    answer ends as it would have (a ban that left nothing would have sampled a refused token)."""
    engine = new_engine(one_step_ahead=one_step_ahead)
    ids = prompt(hf_tokenizer, "json")
    add(engine, "free", ids, json_grammar, max_tokens=60, temperature=0.0)
    add(engine, "min", ids, json_grammar, max_tokens=60, temperature=0.0, min_tokens=60)
    add(engine, "seeded", ids, json_grammar, max_tokens=60, seed=2, min_tokens=60, **SEEDED)
    outputs = run_all(engine)
    assert outputs[("min", 0)].token_ids == outputs[("free", 0)].token_ids
    for key in ("min", "seeded"):
        out = outputs[(key, 0)]
        assert out.finish_reason == "stop" and len(out.token_ids) < 60, out
        jsonschema.validate(json.loads(out.text), SCHEMA)


def _add_all_fields(engine: LLMEngine, tokenizer: Any, grammar: Any) -> None:
    """Requests that use every field: greedy and seeded, n = 2, guided, with long prompts."""
    common: dict[str, Any] = {"max_tokens": 40, "ignore_eos": True}
    add(engine, "rep", prompt(tokenizer, "rep " * 30), temperature=0.0, repetition_penalty=1.3, **common)
    add(engine, "minp", prompt(tokenizer, "min p " * 20), seed=1, n=2, min_p=0.05, **SEEDED, **common)
    add(
        engine,
        "bans",
        prompt(tokenizer, "bans " * 25),
        seed=2,
        n=2,
        bad_words_ids=((1000,), (5000, 6000)),
        allowed_token_ids=tuple(range(1000, 9000)),
        min_tokens=10,
        stop_token_ids=(1001,),
        **SEEDED,
        **common,
    )
    add(
        engine, "stops", prompt(tokenizer, "stops " * 25), temperature=0.0, stop=("e",), include_stop_str_in_output=True
    )
    add(engine, "json", prompt(tokenizer, "json " * 25), grammar, max_tokens=60, seed=3, min_tokens=8, **SEEDED)


def test_the_loops_n_and_preemption_agree_on_every_field(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    def run(num_blocks: int, one_step_ahead: bool) -> tuple[dict[tuple[str, int], tuple[Any, ...]], int]:
        engine = new_engine(num_blocks=num_blocks, max_running=8, one_step_ahead=one_step_ahead)
        _add_all_fields(engine, hf_tokenizer, json_grammar)
        seqs = engine.requests.sequences()
        outputs = run_all(engine)
        assert all(o.finish_reason in ("stop", "length") for o in outputs.values()), outputs
        preemptions = sum(s.num_preemptions for s in seqs)
        return {k: (o.token_ids, o.text, o.finish_reason) for k, o in outputs.items()}, preemptions

    sync, roomy = run(64, False)
    ahead, _ = run(64, True)
    tight, preempted = run(12, False)
    assert roomy == 0 and preempted > 0
    assert ahead == sync and tight == sync and len(sync) == 7
    for index in (0, 1):
        bans = sync[("bans", index)][0]
        assert set(bans) <= set(range(1000, 9000)) and 1000 not in bans
        assert 1001 not in bans[:10] and (1001 not in bans or bans.index(1001) == len(bans) - 1)
    assert sync[("minp", 0)][0] != sync[("minp", 1)][0]
    jsonschema.validate(json.loads(sync[("json", 0)][1]), SCHEMA)
