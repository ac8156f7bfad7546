"""The 220 JSONSchemaBench schemas through ``Pipeline.submit()``: every answer that comes back with
``stop`` validates against its whole schema (checked here again by an independent validator, with
formats), whichever backend constrained it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.errors import GrammarError, InvalidAnswer, PipelineError
from tests.released import assert_released

CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "jsonschemabench"
MAX_TOKENS = 128


def request(schema: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }


def independently_valid(text: str, schema: Any) -> bool:
    try:
        value = json.loads(text)
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
    except jsonschema.SchemaError:
        return True  # a schema this validator cannot read: ours checked it
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.slow
async def test_every_stop_answer_of_the_corpus_validates() -> None:
    schemas = {p.stem: json.loads(p.read_text())["schema"] for p in sorted(CORPUS_DIR.glob("*.json"))}
    config = PipelineConfig(
        max_running_seqs=32,
        max_pending_requests=256,
        stage_queue_size=256,
        max_model_len=2048,
        # the slowest xgrammar compiles (taken when llguidance refuses a keyword) run near 30 s on two
        # loaded cores: a 504 here would be the deadline, not the answer check, under test
        grammar_compile_timeout_s=180,
    )
    counts: Counter[tuple[str, str]] = Counter()
    invalid: list[str] = []
    async with Pipeline(config) as pipe:

        async def one(name: str) -> None:
            try:
                result = await (await pipe.submit(request(schemas[name]))).result()
            except GrammarError:
                counts[("-", "refused (400)")] += 1
                return
            except InvalidAnswer as exc:
                counts[("?", f"invalid answer (422 at {exc.reason})")] += 1
                return
            except PipelineError as exc:
                counts[("-", f"error {exc.status}")] += 1
                return
            backend = result.grammar_backend or "-"
            counts[(backend, result.finish_reason or "none")] += 1
            counts[(backend, "resampled")] += result.num_resamples
            if result.finish_reason == "stop" and not independently_valid(result.text, schemas[name]):
                invalid.append(f"{name}: {result.text[:200]}")

        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                for name in schemas:
                    tg.start_soon(one, name)
        await assert_released(pipe)
        checks = dict(pipe.metrics.answer_checks)
    print(f"\ncorpus through the pipeline: {dict(sorted(counts.items()))}\nanswer checks: {checks}")
    assert not invalid, invalid
    assert sum(n for (_, what), n in counts.items() if what != "resampled") == len(schemas) == 220
    assert not [k for k in counts if k[1].startswith("error")], counts
    assert sum(n for (_, what), n in counts.items() if what == "stop") >= 60
