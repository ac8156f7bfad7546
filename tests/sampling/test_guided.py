"""Guided decoding: regex, choice and EBNF outputs match; JSON outputs validate, n > 1 and the corpus."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from pipeline.errors import UnsupportedSchemaError
from sampling.engine import LLMEngine
from tests.conftest import CorpusEntry
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import add, prompt, run_all

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "tags", "score"],
    "additionalProperties": False,
}
CORPUS_BATCH = 32
CORPUS_MAX_TOKENS = 256


@pytest.mark.parametrize(
    ("kind", "source", "pattern"),
    [
        ("regex", r"\d{3}-[a-z]{2}", r"\d{3}-[a-z]{2}"),
        ("regex", r"(yes|no|maybe)", r"yes|no|maybe"),  # a choice, as a compiled alternation
        ("grammar", 'root ::= "yes" | "no" | "maybe"', r"yes|no|maybe"),
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
    for seed in range(6):
        add(engine, f"s{seed}", prompt(hf_tokenizer, "go"), grammar, max_tokens=40, temperature=1.0, seed=seed)
    add(engine, "greedy", prompt(hf_tokenizer, "go"), grammar, max_tokens=40, temperature=0.0)
    outputs = run_all(engine)
    assert len(outputs) == 7
    for out in outputs.values():
        assert out.finish_reason == "stop", out
        assert re.fullmatch(pattern, out.text), out.text


def test_n4_guided_json_outputs_each_validate(
    engine: LLMEngine, hf_tokenizer: Any, compiler: xgr.GrammarCompiler
) -> None:
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True)
    add(engine, "r", prompt(hf_tokenizer, "four please"), grammar, max_tokens=96, temperature=1.0, seed=7, n=4)
    outputs = run_all(engine)
    assert sorted(outputs) == [("r", i) for i in range(4)]
    assert sum(1 for t in engine.timeline if t.kind == "prefill") == 1
    texts = [outputs[("r", i)].text for i in range(4)]
    for i, text in enumerate(texts):
        assert outputs[("r", i)].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) == 4  # each sequence has its own matcher and generator


@pytest.mark.slow
def test_guided_outputs_validate_for_every_corpus_schema_xgrammar_enforces(
    schema_corpus: list[CorpusEntry], new_engine: NewEngine, hf_tokenizer: Any
) -> None:
    """Every JSONSchemaBench schema that compiles (strict, no free whitespace) runs greedily through
    one engine; an output that stops must validate. Schemas with keywords xgrammar ignores (uniqueItems,
    not, if/then/else, ...) are refused at compile (``stages.schema_support``) and counted as excluded."""
    compiled = [e for e in schema_corpus if e.grammar is not None]
    excluded = [e for e in schema_corpus if isinstance(e.error, UnsupportedSchemaError)]
    engine = new_engine(max_running=CORPUS_BATCH)
    ids = prompt(hf_tokenizer, "Answer in JSON.")
    for entry in compiled:
        add(engine, entry.name, ids, entry.grammar, max_tokens=CORPUS_MAX_TOKENS, temperature=0.0)
    outputs = run_all(engine, max_steps=100_000)
    counts: Counter[str] = Counter()
    invalid: list[str] = []
    for entry in compiled:
        out = outputs[(entry.name, 0)]
        counts[out.finish_reason or "none"] += 1
        if out.finish_reason != "stop":
            continue
        try:
            jsonschema.validate(json.loads(out.text), entry.schema)  # no format checker: formats not checked
            counts["stop+valid"] += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            invalid.append(f"{entry.name}: {str(exc).splitlines()[0]} <- {out.text[:200]}")
        except jsonschema.SchemaError:
            counts["schema the validator rejects"] += 1
    print(
        f"\nguided corpus: {len(schema_corpus)} schemas, compiled {len(compiled)}, "
        f"stop+valid {counts['stop+valid']}, length {counts['length']}, invalid {len(invalid)}, "
        f"excluded (keywords xgrammar ignores) {len(excluded)}, "
        f"compile errors {len(schema_corpus) - len(compiled) - len(excluded)}, "
        f"validator rejects schema {counts['schema the validator rejects']}, error {counts['error']}"
    )
    assert len(compiled) >= 170
    assert counts["error"] == 0 and counts["none"] == 0
    assert not invalid, invalid
    assert counts["stop"] + counts["length"] == len(compiled)
    assert counts["stop+valid"] >= len(compiled) // 3  # the rest write long strings until max_tokens
