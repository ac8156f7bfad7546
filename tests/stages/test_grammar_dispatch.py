"""Each row of the dispatch table, backed by the failure it avoids: xgrammar 0.2.8 lets an answer
through that breaks the row's keyword (or refuses a valid one), llguidance does not."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec
from stages.grammar.dispatch import MAX_XGRAMMAR_NODES, ROWS, Dispatch, choose_backend, schema_nodes
from stages.grammar.schema_walk import SchemaWalk
from tests.grammars import accepts

# row feature -> (schema, an answer that breaks it (or None), a valid answer xgrammar refuses (or None));
# strict, as requests are by default, unless the feature is listed in NOT_STRICT
EVIDENCE: dict[str, tuple[dict[str, Any], str | None, str | None]] = {
    "bounded string": ({"type": "string", "maxLength": 255}, '"a\tb"', None),
    "string pattern": ({"type": "string", "pattern": "^[0-9]+$", "maxLength": 2}, '"1543275"', None),
    "fractional multipleOf": ({"type": "number", "multipleOf": 0.5}, "1.25", None),
    "const/enum holding an object or array": ({"enum": [[1, 2], "x"]}, None, "[1, 2]"),
    "array bounds without items": ({"type": "array", "minItems": 1, "maxItems": 2}, None, "[1]"),
    "patternProperties": (
        {"type": "object", "properties": {"id": {"type": "integer"}}, "patternProperties": {"^i": {"type": "string"}}},
        '{"id": "x"}',
        None,
    ),
    "format": ({"type": "string", "format": "date"}, '"2022-02-31"', None),
    "anyOf beside other keywords": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
        '"not an object"',
        None,
    ),
    "oneOf/allOf": (
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
        "{}",
        None,
    ),
}


NOT_STRICT = {"patternProperties"}  # strict mode closes the object, which hides the overlap


def test_every_row_has_its_evidence() -> None:
    assert {row.feature for row in ROWS} == set(EVIDENCE)


@pytest.mark.parametrize("feature", list(EVIDENCE))
def test_the_row_routes_to_llguidance_and_avoids_what_xgrammar_does(
    feature: str, grammar_compilers: tuple[Any, Any], hf_tokenizer: Any
) -> None:
    schema, broken, refused = EVIDENCE[feature]
    spec = GrammarSpec("json_schema", schema, strict=feature not in NOT_STRICT)
    dispatch = choose_backend(spec)
    assert (dispatch.backend, dispatch.reason) == ("llguidance", feature)
    llguidance = grammar_compilers[1].compile(spec)
    try:
        xgrammar = grammar_compilers[0].compile(spec).grammar
    except GrammarError:  # xgrammar cannot compile this valid schema at all
        assert refused is not None
        xgrammar = None
    if broken is not None:
        assert accepts(xgrammar, broken), "xgrammar enforces it now: the row may go"
        assert not accepts(llguidance.grammar, broken, hf_tokenizer)
        assert llguidance.check.check(broken) is not None  # and the answer check catches it anyway
    if refused is not None:
        assert xgrammar is None or not accepts(xgrammar, refused), "xgrammar accepts it now: the row may go"
        assert accepts(llguidance.grammar, refused, hf_tokenizer)


def test_plain_schemas_and_other_kinds_stay_with_xgrammar() -> None:
    plain = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}}
    assert choose_backend(GrammarSpec("json_schema", plain)).backend == "xgrammar"
    assert choose_backend(GrammarSpec("grammar", 'root ::= "a"')).backend == "xgrammar"
    assert choose_backend(GrammarSpec("structural_tag", {})).backend == "xgrammar"
    assert choose_backend(GrammarSpec("regex", "a+")).backend == "xgrammar"


def test_a_large_schema_goes_to_llguidance() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_XGRAMMAR_NODES)}}
    assert choose_backend(GrammarSpec("json_schema", big)).backend == "llguidance"


def test_schema_nodes_counts_objects_and_arrays_as_the_admission_limit_does() -> None:
    """The size that sends a schema to llguidance is the admission limit's measure: arrays count."""
    # per property one object and one array (its enum): half the nodes are arrays
    schema = {"type": "object", "properties": {f"p{i}": {"enum": ["a", "b"]} for i in range(1_000)}}
    walk = SchemaWalk(schema)
    num_nodes = sum(1 for _ in walk.nodes(10**6))
    assert schema_nodes(schema) == num_nodes == 2 + 1_000 + 1_000
    assert num_nodes > MAX_XGRAMMAR_NODES
    assert choose_backend(GrammarSpec("json_schema", schema)) == Dispatch(
        "llguidance", f"large schema (over {MAX_XGRAMMAR_NODES} nodes)"
    )
    assert schema_nodes({"anyOf": [{"type": "integer"}, [{"x": []}]]}) == 6  # 3 objects, 3 arrays
