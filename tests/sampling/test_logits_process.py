"""logit_bias, presence and frequency penalties, and log probabilities: in the sampler and in both loops."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from sampling.engine import LLMEngine
from sampling.inputs import SeqOutput
from sampling.logits_process import StepLogprobs, adjust
from sampling.params import SamplingParams
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import SEEDED, add, prompt


def test_adjust_matches_a_per_token_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 7.0), (49, -2.0))),
        SamplingParams(),  # untouched
        SamplingParams(frequency_penalty=-1.0),
        SamplingParams(presence_penalty=1.5),
    ]
    outputs = [[1, 1, 3, 7, 1], [1, 2], [9, 9], []]
    expected = logits.clone()
    for row, (p, out) in enumerate(zip(params, outputs, strict=True)):
        for token, value in p.logit_bias:
            expected[row, token] += value
        for token in set(out):
            expected[row, token] -= p.presence_penalty + p.frequency_penalty * out.count(token)
    adjust(logits, params, outputs)
    torch.testing.assert_close(logits, expected)


def test_logprobs_are_the_masked_distribution_without_the_temperature() -> None:
    logits = torch.tensor([[1.0, 2.0, float("-inf"), 0.5], [0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(logprobs=3, temperature=0.3), SamplingParams()]
    step = StepLogprobs.compute(logits, params)
    assert step is not None and step.rows == [0]
    step.pick(torch.tensor([0, 2]))
    out = step.to_host(params, [0, 2])
    reference = torch.log_softmax(logits[0], -1)
    assert list(out) == [0] and out[0].token_id == 0
    assert out[0].logprob == pytest.approx(float(reference[0]))
    assert [t for t, _ in out[0].top] == [1, 0, 3]  # the masked token is no alternative
    assert StepLogprobs.compute(logits, [SamplingParams(), SamplingParams()]) is None


def _run(engine: LLMEngine, max_steps: int = 2000) -> dict[tuple[str, int], list[SeqOutput]]:
    chunks: dict[tuple[str, int], list[SeqOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return chunks
        for out in engine.step():
            chunks.setdefault((out.request_id, out.index), []).append(out)
    raise AssertionError("the engine did not become idle")


def _tokens(chunks: list[SeqOutput]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_greedy_logprobs_top_entry_is_the_chosen_token(engine: LLMEngine, hf_tokenizer: Any) -> None:
    add(engine, "g", prompt(hf_tokenizer, "hello"), max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    add(engine, "plain", prompt(hf_tokenizer, "hello"), max_tokens=6, temperature=0, ignore_eos=True)
    chunks = _run(engine)
    assert _tokens(chunks[("g", 0)]) == _tokens(chunks[("plain", 0)])  # asking for them changes nothing
    assert all(c.logprobs is None for c in chunks[("plain", 0)])
    for chunk in chunks[("g", 0)]:
        assert chunk.logprobs is not None and len(chunk.logprobs) == 1
        entry = chunk.logprobs[0]
        assert entry.token_id == chunk.token_ids[0] and len(entry.top) == 5
        assert entry.top[0] == (entry.token_id, pytest.approx(entry.logprob))
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-5


def test_guided_logprobs_offer_only_tokens_the_grammar_allows(
    engine: LLMEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    """After the mask: the first token of a JSON object must start with '{', and so must every alternative."""
    add(engine, "j", prompt(hf_tokenizer, "json"), json_grammar, max_tokens=4, temperature=0, logprobs=20)
    first = _run(engine)[("j", 0)][0]
    assert first.logprobs is not None
    table = engine.token_bytes.table
    top = first.logprobs[0].top
    assert top and all(table[t].startswith(b"{") for t, _ in top), [table[t] for t, _ in top]
    assert sum(math.exp(v) for _, v in top) <= 1 + 1e-5


def test_logit_bias_moves_and_forces_the_greedy_token(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    ids = prompt(hf_tokenizer, "bias")
    engine = new_engine()
    add(engine, "base", ids, max_tokens=4, temperature=0, ignore_eos=True)
    base = _tokens(_run(engine)[("base", 0)])
    add(engine, "ban", ids, max_tokens=1, temperature=0, ignore_eos=True, logit_bias=((base[0], -100.0),))
    add(engine, "force", ids, max_tokens=4, seed=1, ignore_eos=True, logit_bias=((1000, 100.0),), **SEEDED)
    chunks = _run(engine)
    assert _tokens(chunks[("ban", 0)])[0] != base[0]
    assert _tokens(chunks[("force", 0)]) == [1000] * 4


def test_a_constraint_wins_over_logit_bias(engine: LLMEngine, hf_tokenizer: Any, json_grammar: Any) -> None:
    add(
        engine,
        "j",
        prompt(hf_tokenizer, "json"),
        json_grammar,
        max_tokens=3,
        temperature=0,
        logit_bias=((1000, 100.0),),
    )
    tokens = _tokens(_run(engine)[("j", 0)])
    assert 1000 not in tokens and engine.token_bytes.table[tokens[0]].startswith(b"{")


def test_penalties_stop_and_force_repeats(engine: LLMEngine, hf_tokenizer: Any) -> None:
    """A bias makes token 1000 the greedy choice at every step; a penalty lets it appear once; a
    negative penalty makes the first token repeat."""
    ids = prompt(hf_tokenizer, "repeat repeat")
    bias = {"logit_bias": ((1000, 40.0),), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    add(engine, "biased", ids, **bias)
    add(engine, "presence", ids, presence_penalty=60.0, **bias)
    add(engine, "frequency", ids, frequency_penalty=60.0, **bias)
    add(engine, "negative", ids, max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=-60.0)
    chunks = _run(engine)
    assert _tokens(chunks[("biased", 0)]) == [1000] * 12
    for key in ("presence", "frequency"):
        tokens = _tokens(chunks[(key, 0)])
        assert tokens[0] == 1000 and 1000 not in tokens[1:], key
    negative = _tokens(chunks[("negative", 0)])
    assert negative == [negative[0]] * 12


def test_both_loops_agree_on_logprobs_penalties_and_bias(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    def run(engine: LLMEngine) -> dict[tuple[str, int], list[tuple[Any, ...]]]:
        add(engine, "g", prompt(hf_tokenizer, "a"), max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
        add(engine, "s", prompt(hf_tokenizer, "b"), max_tokens=10, seed=5, ignore_eos=True, logprobs=0, **SEEDED)
        add(
            engine,
            "p",
            prompt(hf_tokenizer, "c"),
            max_tokens=14,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=1.5,
            presence_penalty=0.5,
            logit_bias=((1000, 3.0),),
        )
        add(
            engine,
            "j",
            prompt(hf_tokenizer, "d"),
            json_grammar,
            max_tokens=30,
            temperature=0,
            logprobs=2,
            frequency_penalty=0.5,
        )
        add(engine, "jn", prompt(hf_tokenizer, "e"), json_grammar, max_tokens=30, seed=2, n=2, logprobs=1, **SEEDED)
        bias = ((TOOL_CALLS, 100.0),)
        add(
            engine,
            "t",
            prompt(hf_tokenizer, "f"),
            json_grammar,
            TOOL_CALLS,
            max_tokens=40,
            temperature=0,
            logit_bias=bias,
        )
        return {
            key: [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in chunks]
            for key, chunks in _run(engine).items()
        }

    sync = run(new_engine())
    engine = new_engine(one_step_ahead=True)
    ahead = run(engine)
    assert engine.ahead is not None and engine.ahead.num_ahead > 5
    assert sorted(ahead) == sorted(sync)
    for key, expected in sync.items():
        got = ahead[key]
        assert [c[:3] for c in got] == [c[:3] for c in expected], key
        for mine, theirs in zip(got, expected, strict=True):
            if theirs[3] is None:
                assert mine[3] is None
                continue
            for a, b in zip(mine[3], theirs[3], strict=True):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


TOOL_CALLS = 9  # the Mistral tokenizer's tool-call marker


def test_a_triggered_grammar_holds_only_after_its_marker(
    engine: LLMEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    ids = prompt(hf_tokenizer, "call a tool")
    add(engine, "free", ids, max_tokens=10, temperature=0)
    add(engine, "untriggered", ids, json_grammar, TOOL_CALLS, max_tokens=10, temperature=0)
    bias = ((TOOL_CALLS, 100.0),)
    add(engine, "called", ids, json_grammar, TOOL_CALLS, max_tokens=60, temperature=0, logit_bias=bias)
    chunks = _run(engine)
    assert _tokens(chunks[("untriggered", 0)]) == _tokens(chunks[("free", 0)])  # no marker: no grammar
    called = chunks[("called", 0)]
    tokens = _tokens(called)
    assert tokens[0] == TOOL_CALLS and TOOL_CALLS not in tokens[1:]  # the grammar refuses the marker after it
    assert called[-1].finish_reason == "stop"
    text = "".join(c.text for c in called[1:])  # the marker's own text is the tokenizer's business
    assert json.loads(text).keys() == {"name", "n"}, text
