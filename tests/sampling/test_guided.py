"""Guided decoding: regex, choice and EBNF outputs match; JSON outputs validate, n > 1 and the corpus
(its one decode run in the suite)."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from pipeline.types import GrammarSpec
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


@pytest.mark.parametrize("backend", [0, 1], ids=["xgrammar", "llguidance"])
def test_n4_guided_json_outputs_each_validate(
    engine: LLMEngine, hf_tokenizer: Any, grammar_compilers: tuple[Any, Any], backend: int
) -> None:
    grammar = grammar_compilers[backend].compile(GrammarSpec("json_schema", SCHEMA)).grammar
    add(engine, "r", prompt(hf_tokenizer, "four please"), grammar, max_tokens=96, temperature=1.0, seed=7, n=4)
    outputs = run_all(engine)
    assert sorted(outputs) == [("r", i) for i in range(4)]
    assert sum(1 for t in engine.timeline if t.kind == "prefill") == 1
    texts = [outputs[("r", i)].text for i in range(4)]
    for i, text in enumerate(texts):
        assert outputs[("r", i)].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) == 4  # each sequence has its own matcher and generator


def independent_violation(text: str, schema: Any) -> str | None:
    """Why an independent validator (jsonschema, with formats) refuses ``text``; None when it accepts.
    A schema it cannot read is a refusal too: then nothing has checked the answer a second time."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc})"
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"a schema jsonschema cannot read ({exc.message})"
    error = jsonschema.exceptions.best_match(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    return None if error is None else f"{error.json_path}: {error.message}"


@pytest.mark.slow
@pytest.mark.timeout(900)  # the one guard: about 60 s alone; a loaded machine can take several times that
def test_corpus_grammars_of_both_backends_decode_in_one_batch(
    schema_corpus: list[CorpusEntry], new_engine: NewEngine, hf_tokenizer: Any
) -> None:
    """The corpus's one decode run. Every JSONSchemaBench schema that compiles (strict, no free
    whitespace, each by the backend the dispatch picked, as a request's: xgrammar and llguidance
    matchers share the batches) runs greedily through one engine. The grammar alone is not trusted:
    an output that stops is checked by the answer check, as the pipeline checks every answer before
    it leaves. Every answer it fails must be a keyword the grammar of its backend ignores; every
    answer it passes (what the pipeline serves) must satisfy an independent validator too."""
    assert len(schema_corpus) == 220
    compiled = [e for e in schema_corpus if e.constraint is not None]
    engine = new_engine(max_running=CORPUS_BATCH)
    ids = prompt(hf_tokenizer, "Answer in JSON.")
    for entry in compiled:
        add(engine, entry.name, ids, entry.grammar, max_tokens=CORPUS_MAX_TOKENS, temperature=0.0)
    outputs = run_all(engine, max_steps=100_000)
    counts: Counter[str] = Counter()
    caught: Counter[str] = Counter()
    invalid: list[str] = []
    for entry in compiled:
        out = outputs[(entry.name, 0)]
        assert entry.constraint is not None
        backend = entry.constraint.backend
        counts[f"{backend} {out.finish_reason}"] += 1
        if out.finish_reason != "stop":
            continue
        violation = entry.constraint.check.check(out.text)
        if violation is not None:
            caught[f"{backend} {violation.reason}"] += 1
        elif (why := independent_violation(out.text, entry.schema)) is not None:
            invalid.append(f"{entry.name} ({backend}): {why}; {out.text[:200]}")
    print(f"\nguided corpus in the engine: {dict(sorted(counts.items()))}; caught by the answer check {dict(caught)}")
    assert not invalid, invalid  # an answer the pipeline would have served is invalid
    assert len(compiled) >= 210
    assert not [k for k in counts if k.endswith(("error", "None"))], counts
    assert {k.split()[0] for k in counts} == {"xgrammar", "llguidance"}
    assert sum(n for k, n in counts.items() if k.endswith("stop")) >= len(compiled) // 3
    # what a grammar lets through, only keywords no grammar here enforces
    assert {k.split()[1] for k in caught} <= {
        "uniqueItems",
        "not",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "contains",
        "format",
        "required",
    }, caught
