"""Guided outputs of the embedded model validate for every JSONSchemaBench schema that compiles."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import jsonschema
import pytest

from sampling.detokenizer import TokenBytes
from sampling.model_runner import ModelRunner
from tests.conftest import CorpusEntry
from tests.sampling.helpers import add, make_engine, prompt, run_all

BATCH = 16
MAX_TOKENS = 128


@pytest.mark.slow
def test_guided_outputs_validate_for_every_compiled_schema(
    schema_corpus: list[CorpusEntry], runner: ModelRunner, token_bytes: TokenBytes, hf_tokenizer: Any
) -> None:
    compiled = [e for e in schema_corpus if e.grammar is not None]
    counts: Counter[str] = Counter()
    invalid: list[str] = []
    ids = prompt(hf_tokenizer, "Answer in JSON.")
    for start in range(0, len(compiled), BATCH):
        engine = make_engine(runner, token_bytes, max_running=BATCH)
        chunk = compiled[start : start + BATCH]
        for entry in chunk:
            add(engine, entry.name, ids, entry.grammar, max_tokens=MAX_TOKENS, temperature=0.0)
        outputs = run_all(engine)
        for entry in chunk:
            out = outputs[(entry.name, 0)]
            counts[out.finish_reason or "none"] += 1
            if out.finish_reason != "stop":
                continue
            try:
                jsonschema.validate(json.loads(out.text), entry.schema)
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                invalid.append(f"{entry.name}: {str(exc).splitlines()[0]}")
            except jsonschema.SchemaError:
                counts["schema the validator rejects"] += 1
    print(f"\nguided corpus: {len(compiled)} compiled schemas, {dict(counts)}, invalid {len(invalid)}")
    assert counts["error"] == 0
    assert not invalid, invalid
    assert counts["stop"] >= len(compiled) // 3  # the rest hit max_tokens inside long strings or arrays
