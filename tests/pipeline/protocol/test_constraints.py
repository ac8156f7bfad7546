from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.errors import InvalidRequest
from pipeline.protocol.constraints import CONSTRAINT_FIELDS, parse_constraint
from pipeline.protocol.request_bodies import ChatCompletionRequest, CompletionRequest
from pipeline.protocol.wire import decode_body
from pipeline.types import GrammarSpec

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def body(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, **extra}


def refused(request: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_constraint(request)
    assert info.value.status == 400 and info.value.stage == "admission"
    return info.value


# -- every spelling ---------------------------------------------------------------------------------------
def _structural_tag_new() -> dict[str, Any]:
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<function="],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<function=get_weather>",
                    "content": {"type": "json_schema", "json_schema": SCHEMA},
                    "end": "</function>",
                }
            ],
        },
    }


_LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "schema": SCHEMA, "end": "</function>"}],
    "triggers": ["<function="],
}
# What the legacy shape becomes: xgrammar's own from_legacy_structural_tag conversion.
_LEGACY_NORMALIZED = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "type": "tag",
                "begin": "<function=get_weather>",
                "content": {"type": "json_schema", "json_schema": SCHEMA},
                "end": "</function>",
            }
        ],
        "at_least_one": False,
        "stop_after_first": False,
    },
}

SPELLINGS: list[tuple[dict[str, Any], GrammarSpec]] = [
    # OpenAI
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object", None, field="response_format")),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
        GrammarSpec("json_schema", SCHEMA, field="response_format.json_schema.schema"),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": json.dumps(SCHEMA), "strict": False}}},
        GrammarSpec("json_schema", SCHEMA, strict=False, field="response_format.json_schema.schema"),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "description": "d", "schema": True}}},
        GrammarSpec("json_schema", True, field="response_format.json_schema.schema"),
    ),
    # SGLang's and Fireworks' shortcuts
    (
        {"response_format": {"type": "json_schema", "schema": SCHEMA}},
        GrammarSpec("json_schema", SCHEMA, field="response_format.schema"),
    ),
    (
        {"response_format": {"type": "json_object", "schema": SCHEMA}},
        GrammarSpec("json_schema", SCHEMA, field="response_format.schema"),
    ),
    # structural tags in response_format, both shapes
    (
        {"response_format": _structural_tag_new()},
        GrammarSpec("structural_tag", _structural_tag_new(), field="response_format"),
    ),
    ({"response_format": _LEGACY}, GrammarSpec("structural_tag", _LEGACY_NORMALIZED, field="response_format")),
    # vLLM structured_outputs
    (
        {"structured_outputs": {"json": SCHEMA}},
        GrammarSpec("json_schema", SCHEMA, field="structured_outputs.json"),
    ),
    (
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        GrammarSpec("json_schema", SCHEMA, field="structured_outputs.json"),
    ),
    ({"structured_outputs": {"regex": r"\d+"}}, GrammarSpec("regex", r"\d+", field="structured_outputs.regex")),
    (
        {"structured_outputs": {"choice": ["yes", "no"]}},
        GrammarSpec("choice", ["yes", "no"], field="structured_outputs.choice"),
    ),
    (
        {"structured_outputs": {"grammar": 'root ::= "a"'}},
        GrammarSpec("grammar", 'root ::= "a"', field="structured_outputs.grammar"),
    ),
    (
        {"structured_outputs": {"json_object": True}},
        GrammarSpec("json_object", None, field="structured_outputs.json_object"),
    ),
    (
        {"structured_outputs": {"structural_tag": json.dumps(_structural_tag_new())}},
        GrammarSpec("structural_tag", _structural_tag_new(), field="structured_outputs.structural_tag"),
    ),
    (
        {"structured_outputs": {"structural_tag": {k: v for k, v in _LEGACY.items() if k != "type"}}},
        GrammarSpec("structural_tag", _LEGACY_NORMALIZED, field="structured_outputs.structural_tag"),
    ),
    # vLLM's options ride along harmlessly; nulls are absent
    (
        {
            "structured_outputs": {
                "json": SCHEMA,
                "disable_any_whitespace": False,
                "disable_additional_properties": True,
                "whitespace_pattern": None,
                "backend": "xgrammar",
                "disable_fallback": True,
                "regex": None,
            }
        },
        GrammarSpec("json_schema", SCHEMA, field="structured_outputs.json"),
    ),
    # older vLLM top-level fields
    ({"guided_json": SCHEMA}, GrammarSpec("json_schema", SCHEMA, field="guided_json")),
    ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json_schema", SCHEMA, field="guided_json")),
    ({"guided_regex": "a+"}, GrammarSpec("regex", "a+", field="guided_regex")),
    ({"guided_choice": ["a", "b"]}, GrammarSpec("choice", ["a", "b"], field="guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, GrammarSpec("grammar", 'root ::= "a"', field="guided_grammar")),
    (
        {"guided_regex": "a+", "guided_decoding_backend": "xgrammar:no-fallback"},
        GrammarSpec("regex", "a+", field="guided_regex"),
    ),
    (
        {"structural_tag": json.dumps(_LEGACY)},
        GrammarSpec("structural_tag", _LEGACY_NORMALIZED, field="structural_tag"),
    ),
    # SGLang top-level fields
    ({"json_schema": json.dumps(SCHEMA)}, GrammarSpec("json_schema", SCHEMA, field="json_schema")),
    ({"json_schema": SCHEMA}, GrammarSpec("json_schema", SCHEMA, field="json_schema")),
    ({"ebnf": 'root ::= "a"'}, GrammarSpec("grammar", 'root ::= "a"', field="ebnf")),
    ({"regex": "[ab]"}, GrammarSpec("regex", "[ab]", field="regex")),
    # ours
    ({"grammar": 'root ::= "b"'}, GrammarSpec("grammar", 'root ::= "b"', field="grammar")),
    ({"choice": ["x"]}, GrammarSpec("choice", ["x"], field="choice")),
    # text and nulls are no constraint; text beside a constraint is no conflict
    ({"response_format": {"type": "text"}, "regex": "a"}, GrammarSpec("regex", "a", field="regex")),
]


@pytest.mark.parametrize(("extra", "expected"), SPELLINGS, ids=[json.dumps(e)[:60] for e, _ in SPELLINGS])
def test_every_spelling_gives_its_spec(extra: dict[str, Any], expected: GrammarSpec) -> None:
    spec = parse_constraint(body(**extra))
    assert spec is not None
    assert (spec.kind, spec.value, spec.field, spec.strict) == (
        expected.kind,
        expected.value,
        expected.field,
        expected.strict,
    )
    assert spec.key == expected.key


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"response_format": {"type": "text"}},
        {"response_format": None, "guided_json": None, "structured_outputs": None, "regex": None},
        {"guided_decoding_backend": "outlines"},
        {"guided_whitespace_pattern": None},
        {"response_format": {"type": "text", "json_schema": None}},
    ],
)
def test_no_constraint(extra: dict[str, Any]) -> None:
    assert parse_constraint(body(**extra)) is None


def test_every_spelling_is_a_declared_field() -> None:
    for extra, _ in SPELLINGS:
        decode_body(body(**extra), ChatCompletionRequest)  # an undeclared field would be refused here
        decode_body(json.dumps(body(**extra)).encode(), ChatCompletionRequest)
    assert {"guided_decoding_backend", "guided_whitespace_pattern", "ebnf", "json_schema"} <= CONSTRAINT_FIELDS
    for kind in (ChatCompletionRequest, CompletionRequest):
        assert set(CONSTRAINT_FIELDS) <= set(kind.__struct_fields__)


# -- two constraints -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "first", "second"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "guided_regex": "a"},
            "response_format.json_schema.schema",
            "guided_regex",
        ),
        ({"regex": "a", "structured_outputs": {"json": SCHEMA}}, "regex", "structured_outputs.json"),
        ({"structured_outputs": {"json": SCHEMA}, "regex": "a"}, "structured_outputs.json", "regex"),
        ({"guided_json": SCHEMA, "json_schema": SCHEMA}, "guided_json", "json_schema"),
        ({"regex": "a", "grammar": 'root ::= "a"'}, "regex", "grammar"),
        ({"ebnf": 'root ::= "a"', "guided_choice": ["a"]}, "ebnf", "guided_choice"),
        ({"response_format": {"type": "json_object"}, "choice": ["a"]}, "response_format", "choice"),
        ({"response_format": _LEGACY, "structural_tag": json.dumps(_LEGACY)}, "response_format", "structural_tag"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.regex",
            "structured_outputs.choice",
        ),
        (
            {"response_format": {"type": "json_schema", "schema": SCHEMA}, "guided_grammar": "root ::= x"},
            "response_format.schema",
            "guided_grammar",
        ),
    ],
)
def test_two_constraints_name_the_second_and_list_both(extra: dict[str, Any], first: str, second: str) -> None:
    error = refused(body(**extra))
    assert error.field == second
    assert first in error.message and second in error.message


def test_two_schemas_in_one_response_format() -> None:
    error = refused(body(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}, "schema": SCHEMA}))
    assert error.field == "response_format.schema"


# -- type errors name the field ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"choice": [1]}, "choice"),
        ({"structured_outputs": {"choice": ["a", 2]}}, "structured_outputs.choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"regex": ["a"]}, "regex"),
        ({"ebnf": ""}, "ebnf"),
        ({"guided_grammar": {"x": 1}}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_json": 3}, "guided_json"),
        ({"json_schema": "[" * 100_000}, "json_schema"),
        ({"structured_outputs": {"json": "nope"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        ({"structured_outputs": "regex"}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": "yes"}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"structured_outputs": {"json": SCHEMA, "backend": 1}}, "structured_outputs.backend"),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"json": SCHEMA, "jsn": SCHEMA}}, "structured_outputs.jsn"),
        ({"guided_whitespace_pattern": r"[\n ]*", "guided_json": SCHEMA}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": 3}, "guided_decoding_backend"),
        ({"structural_tag": "{"}, "structural_tag"),
        ({"structural_tag": 5}, "structural_tag"),
        ({"response_format": "json_object"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_object", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": 3}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "description": []}}},
            "response_format.json_schema.description",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strcit": True}}},
            "response_format.json_schema.strcit",
        ),
        ({"response_format": {"type": "json_object", "schema": 3}}, "response_format.schema"),
    ],
)
def test_type_errors_name_the_field(extra: dict[str, Any], field: str) -> None:
    error = refused(body(**extra))
    assert error.field == field, error.message


def test_guided_choice_message_says_what_it_must_be() -> None:
    assert "non-empty list of non-empty strings" in refused(body(guided_choice=[""])).message


def test_body_must_be_an_object() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_constraint([])  # type: ignore[arg-type]
    assert info.value.field == "body"


# -- structural tags ---------------------------------------------------------------------------------------
def _tag(begin: str, content: dict[str, Any] | None = None, end: Any = "</f>") -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content or {"type": "const_string", "value": "x"}, "end": end}


VALID_FORMATS: list[dict[str, Any]] = [
    {"type": "const_string", "value": "hello"},
    {"type": "json_schema", "json_schema": SCHEMA, "style": "json", "any_order": False, "max_whitespace_cnt": 2},
    {"type": "json_schema", "json_schema": True, "excludes": ["bad"]},
    {"type": "qwen_xml_parameter", "json_schema": SCHEMA},
    {"type": "any_text", "excludes": ["<f"], "max_chars": 100},
    {"type": "grammar", "grammar": 'root ::= "a" | "b"'},
    {"type": "regex", "pattern": "[a-z]+"},
    {"type": "sequence", "elements": [{"type": "const_string", "value": "a"}, {"type": "regex", "pattern": "b+"}]},
    {"type": "or", "elements": [{"type": "const_string", "value": "a"}, {"type": "const_string", "value": "b"}]},
    _tag("<a>", end=["</a>", "</b>"]),
    _tag("", end=""),
    {"type": "triggered_tags", "triggers": ["<f"], "tags": [_tag("<f=a>"), _tag("<f=b>")], "at_least_one": True},
    # in a list of tags xgrammar lets "type" default to "tag"
    {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [{"begin": "<f>", "content": {"type": "any_text"}, "end": "x"}],
    },
    {"type": "tags_with_separator", "tags": [_tag("<f>")], "separator": ",", "stop_after_first": True},
    {"type": "optional", "content": {"type": "const_string", "value": "a"}},
    {"type": "plus", "content": {"type": "const_string", "value": "a"}},
    {"type": "star", "content": {"type": "const_string", "value": "a"}},
    {"type": "repeat", "min": 1, "max": 3, "content": {"type": "const_string", "value": "a"}},
    {"type": "repeat", "min": 2, "max": -1, "content": {"type": "const_string", "value": "a"}},
    {"type": "dispatch", "rules": [["<a>", {"type": "const_string", "value": "x"}]], "loop": False},
]


@pytest.mark.parametrize("fmt", VALID_FORMATS, ids=lambda f: f["type"])
def test_valid_structural_tags(fmt: dict[str, Any]) -> None:
    spec = parse_constraint(body(response_format={"type": "structural_tag", "format": fmt}))
    assert spec is not None and spec.kind == "structural_tag" and spec.field == "response_format"
    assert spec.value["type"] == "structural_tag"
    assert spec.value["format"]["type"] == fmt["type"]
    # the same tag in vLLM's structured_outputs (a JSON string, "type" optional there)
    again = parse_constraint(body(structured_outputs={"structural_tag": json.dumps({"format": fmt})}))
    assert again is not None and again.value == spec.value


def test_missing_tag_type_is_filled_in() -> None:
    fmt = {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [{"begin": "<f>", "content": {"type": "any_text"}, "end": "x"}],
    }
    spec = parse_constraint(body(response_format={"type": "structural_tag", "format": fmt}))
    assert spec is not None and spec.value["format"]["tags"][0]["type"] == "tag"


def test_legacy_structural_tag_options() -> None:
    legacy = {**_LEGACY, "at_least_one": True}
    legacy["structures"] = [{"begin": "<function=f>", "schema": json.dumps(SCHEMA), "end": "</function>"}]
    spec = parse_constraint(body(response_format=legacy))
    assert spec is not None
    assert spec.value["format"]["at_least_one"] is True
    assert spec.value["format"]["tags"][0]["content"]["json_schema"] == SCHEMA


def test_normalized_structural_tags_compile_with_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    specs = [parse_constraint(body(response_format={"type": "structural_tag", "format": f})) for f in VALID_FORMATS]
    specs.append(parse_constraint(body(response_format=_LEGACY)))
    for spec in specs:
        assert spec is not None
        xgr.StructuralTag.from_json(spec.value)  # the shape xgrammar's own model accepts
        xgr.Grammar.from_structural_tag(json.dumps(spec.value))  # and compiles
    # our legacy conversion is xgrammar's
    item = xgr.StructuralTagItem(begin="<function=get_weather>", schema=json.dumps(SCHEMA), end="</function>")
    theirs = xgr.StructuralTag.from_legacy_structural_tag([item], ["<function="])
    ours = xgr.StructuralTag.from_json(_LEGACY_NORMALIZED)
    assert ours == theirs


RF = "response_format"


@pytest.mark.parametrize(
    ("rf", "field"),
    [
        # legacy shape
        ({"type": "structural_tag"}, f"{RF}.format"),
        ({"type": "structural_tag", "structures": [], "triggers": ["<f"]}, f"{RF}.structures"),
        ({"type": "structural_tag", "structures": "x", "triggers": ["<f"]}, f"{RF}.structures"),
        ({**_LEGACY, "triggers": []}, f"{RF}.triggers"),
        ({**_LEGACY, "triggers": [""]}, f"{RF}.triggers"),
        ({**_LEGACY, "triggers": "<function="}, f"{RF}.triggers"),
        ({k: v for k, v in _LEGACY.items() if k != "triggers"}, f"{RF}.triggers"),
        ({**_LEGACY, "structures": ["x"]}, f"{RF}.structures[0]"),
        ({**_LEGACY, "structures": [{"begin": 1, "schema": SCHEMA, "end": "e"}]}, f"{RF}.structures[0].begin"),
        ({**_LEGACY, "structures": [{"begin": "<function=", "schema": SCHEMA}]}, f"{RF}.structures[0].end"),
        ({**_LEGACY, "structures": [{"begin": "<function=", "end": "e"}]}, f"{RF}.structures[0].schema"),
        (
            {**_LEGACY, "structures": [{"begin": "<function=", "schema": "[]", "end": "e"}]},
            f"{RF}.structures[0].schema",
        ),
        (
            {**_LEGACY, "structures": [{"begin": "<function=", "schema": SCHEMA, "end": "e", "stop": "x"}]},
            f"{RF}.structures[0].stop",
        ),
        (
            {**_LEGACY, "structures": [*_LEGACY["structures"], {"begin": "<tool>", "schema": SCHEMA, "end": "e"}]},
            f"{RF}.structures[1].begin",
        ),
        ({**_LEGACY, "triggers": ["<f", "<function="]}, f"{RF}.structures[0].begin"),
        ({**_LEGACY, "at_least_one": "yes"}, f"{RF}.at_least_one"),
        ({**_LEGACY, "stop_after_first": True}, f"{RF}.stop_after_first"),
        ({**_LEGACY, "format": {"type": "any_text"}}, RF),
        # xgrammar 0.2 shape
        ({"type": "structural_tag", "format": "x"}, f"{RF}.format"),
        ({"type": "structural_tag", "format": {}}, f"{RF}.format.type"),
        ({"type": "structural_tag", "format": {"type": "nope"}}, f"{RF}.format.type"),
        ({"type": "structural_tag", "format": {"type": "const_string"}}, f"{RF}.format.value"),
        ({"type": "structural_tag", "format": {"type": "const_string", "value": 1}}, f"{RF}.format.value"),
        ({"type": "structural_tag", "format": {"type": "const_string", "value": "a", "x": 1}}, f"{RF}.format.x"),
        ({"type": "structural_tag", "format": {"type": "regex", "pattern": ""}}, f"{RF}.format.pattern"),
        (
            {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": "{}"}},
            f"{RF}.format.json_schema",
        ),
        (
            {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {}, "style": "yaml"}},
            f"{RF}.format.style",
        ),
        ({"type": "structural_tag", "format": {"type": "sequence", "elements": []}}, f"{RF}.format.elements"),
        (
            {"type": "structural_tag", "format": {"type": "or", "elements": [{"type": "regex", "pattern": 1}]}},
            f"{RF}.format.elements[0].pattern",
        ),
        ({"type": "structural_tag", "format": _tag("<a>", end=[])}, f"{RF}.format.end"),
        ({"type": "structural_tag", "format": _tag("<a>", end=5)}, f"{RF}.format.end"),
        ({"type": "structural_tag", "format": {**_tag("<a>"), "content": None}}, f"{RF}.format.content"),
        (
            {"type": "structural_tag", "format": _tag("<a>", content={"type": "any_text", "max_chars": -1})},
            f"{RF}.format.content.max_chars",
        ),
        (
            {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": []}},
            f"{RF}.format.tags",
        ),
        (
            {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [], "tags": [_tag("<f>")]}},
            f"{RF}.format.triggers",
        ),
        (
            {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<g"], "tags": [_tag("<f>")]}},
            f"{RF}.format.tags[0].begin",
        ),
        (
            {
                "type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [{"type": "regex", "pattern": "a"}]},
            },
            f"{RF}.format.tags[0].type",
        ),
        (
            {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": [_tag("<f>")]}},
            f"{RF}.format.separator",
        ),
        (
            {"type": "structural_tag", "format": {"type": "repeat", "min": 3, "max": 2, "content": _tag("a")}},
            f"{RF}.format.max",
        ),
        (
            {"type": "structural_tag", "format": {"type": "repeat", "min": True, "max": 2, "content": _tag("a")}},
            f"{RF}.format.min",
        ),
        (
            {"type": "structural_tag", "format": {"type": "dispatch", "rules": [["<a>"]]}},
            f"{RF}.format.rules[0]",
        ),
        # token-level formats: the answer check sees text only
        ({"type": "structural_tag", "format": {"type": "token", "token": 5}}, f"{RF}.format.type"),
        ({"type": "structural_tag", "format": {"type": "any_tokens"}}, f"{RF}.format.type"),
        (
            {"type": "structural_tag", "format": {**_tag("<a>"), "begin": {"type": "token", "token": "<a>"}}},
            f"{RF}.format.begin",
        ),
        ({"type": "json_schema", "format": {"type": "any_text"}}, f"{RF}.format"),  # wrong type: unknown key
    ],
)
def test_invalid_structural_tags_name_the_field(rf: dict[str, Any], field: str) -> None:
    error = refused(body(response_format=rf))
    assert error.field == field, error.message


def test_structural_tag_type_must_be_structural_tag_elsewhere() -> None:
    tag = {"type": "json_schema", "format": {"type": "any_text"}}
    assert refused(body(structural_tag=json.dumps(tag))).field == "structural_tag.type"


def test_deep_structural_tags_are_refused_not_crashed() -> None:
    fmt: dict[str, Any] = {"type": "const_string", "value": "x"}
    for _ in range(200):
        fmt = {"type": "optional", "content": fmt}
    error = refused(body(response_format={"type": "structural_tag", "format": fmt}))
    assert "deeper" in error.message
