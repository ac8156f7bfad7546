"""Reasoning before a constrained answer, in the engine: no mask and no matcher before the end tag, the
grammar from the token after it, with both backends, seeded and greedy, in both step loops, with
n > 1, preemption and prefix hits; no end of sequence while a constrained answer is owed; a bound
on the reasoning that forces its end.

The embedded model has no reasoning tags, so one ordinary token stands for the end tag here; where
the reasoning ends is set by ``max_reasoning_tokens`` (the tag is then forced) or by a logit bias.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput
from sampling.params import SamplingParams
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import EOS, IMAGE_TOKEN, SCHEMA, SEEDED, prompt, run_all

END = 1500  # the end-of-reasoning tag, as far as the engine knows


def add(engine: LLMEngine, request_id: str, ids: list[int], grammar: Any = None, **params: Any) -> None:
    sampling = SamplingParams(**params)
    engine.add(EngineInput(request_id, ids, IMAGE_TOKEN, None, sampling, grammar, None, reasoning_end=END))


def answer_text(token_bytes: TokenBytes, out: SeqOutput) -> str:
    """The text after the end tag."""
    after = out.token_ids[out.token_ids.index(END) + 1 :]
    return b"".join(token_bytes.table[t] for t in after).decode()


@pytest.mark.parametrize("one_step_ahead", [False, True])
@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"seed": 11, **SEEDED}], ids=["greedy", "seeded"])
def test_the_reasoning_is_free_and_the_answer_after_its_end_follows_the_grammar(
    new_engine: NewEngine,
    hf_tokenizer: Any,
    json_grammar: Any,
    token_bytes: TokenBytes,
    params: dict[str, Any],
    one_step_ahead: bool,
) -> None:
    ids = prompt(hf_tokenizer, "Think first, then answer in JSON.")
    engine = new_engine(one_step_ahead=one_step_ahead)
    add(engine, "guided", ids, json_grammar, max_tokens=80, max_reasoning_tokens=6, **params)
    # the same request without a constraint: no end of sequence either (a constrained one owes an answer)
    add(engine, "free", ids, None, max_tokens=7, max_reasoning_tokens=6, ignore_eos=True, **params)
    outputs = run_all(engine)
    guided, free = outputs[("guided", 0)], outputs[("free", 0)]
    assert guided.finish_reason == "stop", guided
    # the reasoning is what the model writes unconstrained, token for token; the end tag is forced after it
    assert guided.token_ids[:6] == free.token_ids[:6]
    assert guided.token_ids[6] == END and free.token_ids[6] == END
    jsonschema.validate(json.loads(answer_text(token_bytes, guided)), SCHEMA)


def test_the_reasoning_ends_where_the_model_writes_the_tag(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, token_bytes: TokenBytes
) -> None:
    """A biased end tag: the reasoning is empty and the answer starts at the second token."""
    engine = new_engine()
    add(
        engine,
        "r",
        prompt(hf_tokenizer, "answer"),
        json_grammar,
        max_tokens=80,
        temperature=0.0,
        logit_bias=((END, 100.0),),
    )
    out = run_all(engine)[("r", 0)]
    assert out.token_ids[0] == END and out.finish_reason == "stop"
    jsonschema.validate(json.loads(answer_text(token_bytes, out)), SCHEMA)


def test_no_end_of_sequence_while_a_constrained_answer_is_owed(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, token_bytes: TokenBytes
) -> None:
    """EOS biased to the top: the unconstrained request ends at once, the constrained one reasons on to
    its bound, then writes an answer its grammar completes (only then may EOS end it)."""
    engine = new_engine()
    bias = ((EOS[0], 100.0),)
    ids = prompt(hf_tokenizer, "stop?")
    add(engine, "guided", ids, json_grammar, max_tokens=80, temperature=0.0, logit_bias=bias, max_reasoning_tokens=4)
    add(engine, "free", ids, None, max_tokens=80, temperature=0.0, logit_bias=bias, max_reasoning_tokens=4)
    outputs = run_all(engine)
    assert outputs[("free", 0)].token_ids == EOS
    guided = outputs[("guided", 0)]
    assert EOS[0] not in guided.token_ids[:4] and guided.token_ids[4] == END
    assert guided.token_ids[-1] == EOS[0] and guided.finish_reason == "stop"
    jsonschema.validate(json.loads(answer_text(token_bytes, guided)), SCHEMA)


def test_running_out_of_tokens_while_reasoning_is_a_length_finish_and_builds_no_matcher(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    engine = new_engine()
    add(engine, "r", prompt(hf_tokenizer, "long thought"), json_grammar, max_tokens=5, temperature=0.0)
    (seq,) = engine.requests.sequences()
    built = []
    for _ in range(50):
        if not engine.has_work():
            break
        outs = engine.step()
        built.append(seq.matcher is not None)
        if outs and outs[-1].finish_reason is not None:
            assert outs[-1].finish_reason == "length"
    assert len(seq.output_ids) == 5 and END not in seq.output_ids
    assert not any(built) and seq.grammar_start is None


@pytest.mark.parametrize("n", [3])
def test_n_siblings_each_reason_then_answer(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, token_bytes: TokenBytes, n: int
) -> None:
    engine = new_engine()
    ids = prompt(hf_tokenizer, "three answers")
    add(engine, "r", ids, json_grammar, max_tokens=80, n=n, seed=3, max_reasoning_tokens=5, **SEEDED)
    outputs = run_all(engine)
    assert len(outputs) == n
    for out in outputs.values():
        assert out.finish_reason == "stop" and out.token_ids[5] == END
        jsonschema.validate(json.loads(answer_text(token_bytes, out)), SCHEMA)
    assert len({tuple(o.token_ids[:5]) for o in outputs.values()}) > 1  # each sibling reasons on its own


@pytest.mark.parametrize("chunk_tokens", [2048, 8])
def test_preemption_replays_the_answer_only_and_reproduces_the_tokens(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, token_bytes: TokenBytes, chunk_tokens: int
) -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], dict[str, SeqOutput], int]:
        engine = new_engine(num_blocks=num_blocks, max_running=8, chunk_tokens=chunk_tokens)
        for i in range(6):
            ids = prompt(hf_tokenizer, f"guided {i} " * 6)
            add(engine, f"g{i}", ids, json_grammar, max_tokens=60, temperature=0, max_reasoning_tokens=3 + i)
        ids = prompt(hf_tokenizer, "seeded")
        add(engine, "seeded", ids, json_grammar, max_tokens=60, seed=5, max_reasoning_tokens=8, **SEEDED)
        seqs = engine.requests.sequences()
        outputs = run_all(engine)
        return (
            {k[0]: o.token_ids for k, o in outputs.items()},
            {k[0]: o for k, o in outputs.items()},
            sum(s.num_preemptions for s in seqs),
        )

    roomy, _, roomy_preemptions = run(64)
    tight, outputs, tight_preemptions = run(8)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy
    for out in outputs.values():
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(answer_text(token_bytes, out)), SCHEMA)


def test_a_prefix_hit_reasons_and_answers_as_a_cold_start(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any
) -> None:
    engine = new_engine()
    ids = prompt(hf_tokenizer, "a prompt long enough to fill a few cache blocks " * 4)
    add(engine, "cold", ids, json_grammar, max_tokens=60, temperature=0.0, max_reasoning_tokens=5)
    cold = run_all(engine)[("cold", 0)]
    hits = engine.scheduler.allocator.stats.hits
    add(engine, "warm", ids, json_grammar, max_tokens=60, temperature=0.0, max_reasoning_tokens=5)
    warm = run_all(engine)[("warm", 0)]
    assert engine.scheduler.allocator.stats.hits > hits
    assert warm.token_ids == cold.token_ids and warm.finish_reason == cold.finish_reason == "stop"


def test_forced_tokens_start_with_the_answer_not_in_the_reasoning(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: Any, token_bytes: TokenBytes
) -> None:
    """With forcing on, the reasoning is the same free tokens; what the grammar forces is written from
    the answer's first token on."""
    ids = prompt(hf_tokenizer, "Think, then answer.")
    runs = {}
    for forced in (False, True):
        encode = lambda text: list(hf_tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        engine = new_engine(forced_tokens=forced, encode=encode)
        add(engine, "r", ids, json_grammar, max_tokens=80, temperature=0.0, max_reasoning_tokens=5)
        runs[forced] = (run_all(engine)[("r", 0)], engine.parts.num_forced)
    (plain, _), (forced_out, num_forced) = runs[False], runs[True]
    assert num_forced > 0
    assert forced_out.token_ids[:6] == plain.token_ids[:6] and forced_out.token_ids[5] == END
    jsonschema.validate(json.loads(answer_text(token_bytes, forced_out)), SCHEMA)
