"""The keyword lists of stages/schema_support.py, checked against xgrammar itself.

Each case compiles a schema that differs from a plain one by a single keyword, then feeds the grammar
an instance that violates only that keyword. An xgrammar upgrade that changes an answer fails here,
so the list of refused keywords is kept honest.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from pipeline.errors import UnsupportedSchemaError
from stages.schema_support import IGNORED_FORMATS, IGNORED_KEYWORDS, check_schema_support, find_unsupported

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
ENFORCED = {
    "minimum": ({"type": "integer", "minimum": 5}, 3),
    "maxLength": ({"type": "string", "maxLength": 2}, "abcd"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "b"),
    "format email": ({"type": "string", "format": "email"}, "nope"),
    "format date-time": ({"type": "string", "format": "date-time"}, "nope"),
    "enum": ({"enum": [1, 2]}, 3),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, [1, 2]),
    "additionalProperties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        {"a": 1, "b": 1},
    ),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),
    "oneOf of disjoint types": ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, True),
}


def grammar_accepts(compiler: xgr.GrammarCompiler, schema: Any, instance: Any) -> bool:
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(json.dumps(instance)) and matcher.accept_token(2)


@pytest.fixture(scope="module")
def compiler(tokenizer_info: Any) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(tokenizer_info)


@pytest.mark.parametrize("name", list(IGNORED))
def test_xgrammar_ignores_what_we_refuse(compiler: xgr.GrammarCompiler, name: str) -> None:
    schema, violating = IGNORED[name]
    assert grammar_accepts(compiler, schema, violating), f"xgrammar now enforces {name}: stop refusing it"
    assert find_unsupported(schema), f"{name} must be refused"


@pytest.mark.parametrize("name", list(ENFORCED))
def test_xgrammar_enforces_what_we_accept(compiler: xgr.GrammarCompiler, name: str) -> None:
    schema, violating = ENFORCED[name]
    assert not grammar_accepts(compiler, schema, violating), f"xgrammar ignores {name}: refuse it"
    assert find_unsupported(schema) == []


def test_the_lists_cover_the_keywords_tested() -> None:
    assert {
        "uniqueItems",
        "contains",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependencies",
    } <= IGNORED_KEYWORDS
    assert "regex" in IGNORED_FORMATS


def test_pointers() -> None:
    schema = {"$defs": {"tag": {"type": "array", "uniqueItems": True}}, "properties": {"x": {"not": {}}}}
    assert find_unsupported(schema) == ["/properties/x/not", "/$defs/tag/uniqueItems"]
    check_schema_support(schema, strict=True, field="f")  # the answer check holds these: accepted


def test_only_what_nothing_can_hold_is_refused_and_only_when_strict() -> None:
    schema = {"properties": {"a": {"$ref": "https://example.com/a.json"}, "b": {"enum": [{"$ref": "x"}]}}}
    with pytest.raises(UnsupportedSchemaError) as info:
        check_schema_support(schema, strict=True, field="response_format.json_schema.schema")
    assert info.value.field == "response_format.json_schema.schema"
    assert info.value.keywords == ["/properties/a/$ref (remote: https://example.com/a.json)"]
    check_schema_support(schema, strict=False, field="f")  # documented: accepted as any value
