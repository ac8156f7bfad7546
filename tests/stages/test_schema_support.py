"""What ``stages/grammar/schema_support.py`` refuses: only what neither a grammar nor the answer check can hold.

Keywords xgrammar 0.2.8 ignores (each case: a schema and an instance that violates only that keyword)
are accepted, since every answer is validated against the whole schema; a remote ``$ref`` is not.
"""

from __future__ import annotations

import pytest

from pipeline.errors import UnsupportedSchemaError
from stages.grammar.schema_support import check_schema_support

IGNORED = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1, 2]),
    "not": ({"type": "integer", "not": {"const": 3}}, 3),
    "if": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]},
        },
        {"a": 1},
    ),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1},
    ),
    "dependencies": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependencies": {"a": ["b"]},
        },
        {"a": 1},
    ),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 3),
    "format regex": ({"type": "string", "format": "regex"}, "(("),
    "anyOf of required": (
        {"type": "object", "properties": {"id": {"type": "string"}}, "anyOf": [{"required": ["id"]}]},
        {},
    ),
}


@pytest.mark.parametrize("name", list(IGNORED))
def test_keywords_the_grammar_ignores_are_accepted(name: str) -> None:
    schema, _ = IGNORED[name]
    check_schema_support(schema, strict=True, field="f")  # the answer check holds them


def test_only_what_nothing_can_hold_is_refused_and_only_when_strict() -> None:
    schema = {"properties": {"a": {"$ref": "https://example.com/a.json"}, "b": {"enum": [{"$ref": "x"}]}}}
    with pytest.raises(UnsupportedSchemaError) as info:
        check_schema_support(schema, strict=True, field="response_format.json_schema.schema")
    assert info.value.field == "response_format.json_schema.schema"
    assert info.value.keywords == ["/properties/a/$ref (remote: https://example.com/a.json)"]
    check_schema_support(schema, strict=False, field="f")  # documented: accepted as any value
