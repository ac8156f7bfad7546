"""The answer gate: a structured answer is returned with ``stop`` only after it passes its whole
constraint; failures are resampled (without streaming) or end the stream with an error."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest

from pipeline import PipelineConfig
from pipeline.answer.answer_gate import AnswerGate, resample_params
from pipeline.core.pipeline import Pipeline
from pipeline.errors import InvalidAnswer
from pipeline.types import GrammarSpec
from sampling.params import SamplingParams
from stages.grammar.answer_check import build_answer_check
from tests.released import assert_released


@dataclass(frozen=True)
class D:
    index: int
    text: str
    finish_reason: str | None = None


def gate(is_streaming: bool) -> AnswerGate[D]:
    check = build_answer_check(GrammarSpec("json_schema", {"type": "array", "uniqueItems": True}))
    return AnswerGate(check, "xgrammar", is_streaming, Counter())


def test_without_streaming_deltas_are_held_until_the_answer_passes() -> None:
    g = gate(is_streaming=False)
    assert g.feed(D(0, "[1, "), "[1, ") == []
    out = g.feed(D(0, "2]", "stop"), "[1, 2]")
    assert [d.text for d in out] == ["[1, ", "2]"] and not g.failed
    assert g.counts == Counter({("xgrammar", "passed", ""): 1})


def test_without_streaming_a_failed_answer_is_never_shown() -> None:
    g = gate(is_streaming=False)
    assert g.feed(D(1, "[1, "), "[1, ") == []
    assert g.feed(D(1, "1]", "stop"), "[1, 1]") == []
    assert g.failed[1].path == "" and g.failed[1].reason == "uniqueItems" and g.failed[1].status == 422
    assert g.counts == Counter({("xgrammar", "failed", "uniqueItems"): 1})


def test_streaming_passes_text_at_once_and_holds_only_the_stop() -> None:
    g = gate(is_streaming=True)
    assert [d.text for d in g.feed(D(0, "[1, "), "[1, ")] == ["[1, "]
    with pytest.raises(InvalidAnswer) as info:
        g.feed(D(0, "1]", "stop"), "[1, 1]")
    assert info.value.reason == "uniqueItems" and "does not satisfy" in info.value.message


def test_an_answer_cut_by_max_tokens_claims_nothing_and_is_not_checked() -> None:
    g = gate(is_streaming=False)
    g.feed(D(0, "[1, "), "[1, ")
    assert [d.text for d in g.feed(D(0, "1", "length"), "[1, 1")] == ["[1, ", "1"]
    assert not g.counts


def test_resample_params_derive_the_seed_and_sample_when_greedy() -> None:
    greedy = SamplingParams(temperature=0.0, n=3, seed=None)
    first, second = (resample_params(greedy, index=1, attempt=a) for a in (1, 2))
    assert first.n == 1 and first.temperature == 1.0 and first.seed != second.seed
    seeded = SamplingParams(temperature=0.7, seed=42, n=2)
    again = resample_params(seeded, index=0, attempt=1)
    assert again == resample_params(seeded, index=0, attempt=1)  # reproducible from the request's seed
    assert again.temperature == 0.7 and again.seed != 42


# -- through the pipeline ---------------------------------------------------------------------------
# Three distinct items out of {0, 1, 2}: the grammar enforces the enum and the length, not uniqueItems
# (no backend does), so greedy decoding of the embedded model writes a repeat that only the check sees.
UNIQUE = {
    "type": "array",
    "items": {"type": "integer", "enum": [0, 1, 2]},
    "minItems": 3,
    "maxItems": 3,
    "uniqueItems": True,
}
IMPOSSIBLE = {**UNIQUE, "items": {"type": "integer", "enum": [0, 1]}}  # three distinct out of two


def body(schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Three numbers."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "max_tokens": 32,
        **extra,
    }


@pytest.fixture
async def pipe() -> AsyncIterator[Pipeline]:
    # text only: no preparation worker would run, so none is started
    config = PipelineConfig(
        max_running_seqs=8,
        num_kv_blocks=256,
        max_model_len=1024,
        answer_resample_attempts=8,
        preparation_mode="thread",
        engine_mode="thread",
    )
    async with Pipeline(config) as p:
        yield p


async def test_a_failed_answer_is_resampled_until_it_passes(pipe: Pipeline) -> None:
    result = await (await pipe.submit(body(UNIQUE, temperature=0.0))).result()
    assert result.finish_reason == "stop" and result.num_resamples >= 1
    jsonschema.validate(json.loads(result.text), UNIQUE)
    checks = pipe.metrics.answer_checks
    assert checks[(result.grammar_backend, "failed", "uniqueItems")] == result.num_resamples
    assert checks[(result.grammar_backend, "passed", "")] == 1
    assert 'pipeline_answer_checks_total{backend="' in pipe.render_metrics().decode()
    await assert_released(pipe)


async def test_no_attempt_passing_is_a_422_naming_the_violation(pipe: Pipeline) -> None:
    handle = await pipe.submit(body(IMPOSSIBLE, temperature=0.0, n=2))
    deltas = [d async for d in _until_error(handle)]
    assert deltas == []  # nothing of a failed answer is ever shown
    with pytest.raises(InvalidAnswer) as info:
        await handle.result()
    assert info.value.status == 422 and info.value.reason == "uniqueItems" and info.value.path == ""
    assert "8 resamples" in info.value.message
    await assert_released(pipe)


async def test_streaming_a_failed_answer_ends_with_an_error_and_no_stop(pipe: Pipeline) -> None:
    handle = await pipe.submit(body(IMPOSSIBLE, temperature=0.0, stream=True))
    deltas = []
    with pytest.raises(InvalidAnswer) as info:
        async for delta in handle:
            deltas.append(delta)
    assert deltas and all(d.finish_reason is None for d in deltas)  # the text streamed, the stop did not
    assert info.value.reason == "uniqueItems"
    assert pipe.metrics.answer_resamples == 0  # streamed text cannot be taken back: no resample
    await assert_released(pipe)


async def _until_error(handle: Any) -> AsyncIterator[Any]:
    try:
        async for delta in handle:
            yield delta
    except InvalidAnswer:
        return
