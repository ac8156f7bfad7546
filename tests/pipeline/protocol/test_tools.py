"""Tool plans from tools/tool_choice, template ids, and the call reader against whole and chunked answers."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from pipeline.errors import GrammarError, InvalidRequest
from pipeline.protocol import tools as tools_module
from pipeline.protocol.request_bodies import ChatCompletionRequest
from pipeline.protocol.tool_calls import CallReader, CallStart
from pipeline.protocol.tools import new_call_id, plan_tools, template_call_id

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def body(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def test_plans_per_tool_choice() -> None:
    assert plan_tools(body(), False) is None
    assert plan_tools(body(tools=[WEATHER], tool_choice="none"), False) is None
    auto = plan_tools(body(tools=[WEATHER, TIME]), False)
    assert auto is not None and auto.mode == "auto" and not auto.starts_with_call
    schema = auto.grammar.value
    jsonschema.validate(
        [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}], schema
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"x": 1}}], schema)  # no parameters: exactly {}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    named = plan_tools(
        body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}), False
    )
    assert named is not None and named.mode == "named" and named.starts_with_call
    with pytest.raises(jsonschema.ValidationError):  # one call, to that function alone
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "x"}}], named.grammar.value)
    single = plan_tools(body(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), False)
    assert single is not None and single.grammar.value["maxItems"] == 1


@pytest.mark.parametrize(
    ("fields", "other", "where"),
    [
        ({"tool_choice": "required"}, False, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, False, "tools[1].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            False,
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER]}, True, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            False,
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_requests_name_the_field(fields: dict[str, Any], other: bool, where: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        plan_tools(body(**fields), other)
    assert caught.type is InvalidRequest and caught.value.field == where


def test_call_ids_fit_the_template() -> None:
    fresh = new_call_id()
    assert len(fresh) == 9 and fresh.isalnum() and template_call_id(fresh) == fresh
    mapped = template_call_id("call_abc123-long-id")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == template_call_id("call_abc123-long-id")


ANSWER = (
    '[{"name": "get_weather", "arguments": {"city": "O\\"slo {x}", "n": [1, {"a": 2}]}}, '
    '{"name": "get_time", "arguments": {}}]'
)


@pytest.mark.parametrize("size", [1, 2, 5, len(ANSWER)])
def test_the_reader_gives_names_first_and_the_exact_arguments_in_any_chunks(size: int) -> None:
    reader = CallReader()
    events = []
    for i in range(0, len(ANSWER), size):
        events += reader.feed(ANSWER[i : i + size])
    expected = [(c["name"], json.dumps(c["arguments"])) for c in json.loads(ANSWER)]
    assert [(c.name, c.arguments) for c in reader.calls] == expected
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [s.name for s in starts] == ["get_weather", "get_time"]
    for index, (_, arguments) in enumerate(expected):  # fragments come after their call's start
        first = events.index(starts[index])
        fragments = [e[1] for e in events[first:] if isinstance(e, tuple) and e[0] == index]
        assert "".join(fragments) == arguments


def test_parameters_with_local_refs_keep_their_meaning(grammar_compilers: tuple[Any, Any]) -> None:
    """``#/definitions/x`` in a function's parameters means its own root, not the call array's."""
    parameters = {
        "$id": "https://example.com/p.json",
        "type": "object",
        "definitions": {
            "unit": {"enum": ["C", "F"]},
            "node": {"type": "object", "properties": {"next": {"$ref": "#"}}},
        },
        "properties": {"unit": {"$ref": "#/definitions/unit"}, "tree": {"$ref": "#/definitions/node"}},
        "required": ["unit"],
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    plan = plan_tools(body(tools=[tool, TIME], tool_choice="required"), False)
    assert plan is not None
    schema = plan.grammar.value
    jsonschema.validate([{"name": "f", "arguments": {"unit": "C", "tree": {"next": {"unit": "F"}}}}], schema)
    for bad in ({"unit": "K"}, {"unit": "C", "tree": {"next": {"unit": 1}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "f", "arguments": bad}], schema)
    for compiler in grammar_compilers:  # both backends resolve the moved refs
        assert compiler.compile(plan.grammar).grammar is not None


def tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(
    "parameters",
    [{"$ref": "#"}, {"not": {}}, {"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]}],
    ids=["ref cycle", "not anything", "required property admits nothing"],
)
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_parameters_that_admit_nothing_are_refused_by_field(parameters: Any, choice: str) -> None:
    # {"$ref": "#"} with tool_choice required was a 500 mid-answer ("token 0 was rejected")
    with pytest.raises(InvalidRequest, match="admit no value") as caught:
        plan_tools(body(tools=[WEATHER, tool(parameters)], tool_choice=choice), False)
    assert caught.value.field == "tools[1].function.parameters"


def test_open_parameters_still_take_an_object() -> None:
    # parameters {} let the model write "arguments": -24587
    plan = plan_tools(body(tools=[tool({})], tool_choice="required"), False)
    assert plan is not None
    jsonschema.validate([{"name": "f", "arguments": {"x": [1]}}], plan.grammar.value)
    for value in (-24587, True, "x", [1], None):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "f", "arguments": value}], plan.grammar.value)


@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_the_reader_reads_any_json_value_as_arguments(size: int) -> None:
    # a number was cut to its first character: "arguments": -24587 read as "-"
    answer = (
        '[{"name": "a", "arguments": -24587}, {"name": "b", "arguments": true }, '
        '{"name": "c", "arguments": "s}"}, {"name": "d", "arguments": null}, {"name": "e", "arguments": 1.5e3}]'
    )
    reader = CallReader()
    for i in range(0, len(answer), size):
        reader.feed(answer[i : i + size])
    assert [(c.name, c.arguments) for c in reader.calls] == [
        ("a", "-24587"),
        ("b", "true"),
        ("c", '"s}"'),
        ("d", "null"),
        ("e", "1.5e3"),
    ]


def _with_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(
    ("parameters", "ref", "at"),
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}},
            "#/definitions/missing",
            "/properties/a",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/y"}}, "$defs": {"x": {"type": "string"}}},
            "#/$defs/y",
            "/properties/a",
        ),
        ({"type": "object", "anyOf": [{"type": "object"}, {"$ref": "#/nowhere"}]}, "#/nowhere", "/anyOf/1"),
        ({"$ref": "#anchor", "type": "object"}, "#anchor", "/"),
    ],
)
def test_a_ref_to_nothing_names_the_tools_own_parameters_and_path(
    parameters: dict[str, Any], ref: str, at: str
) -> None:
    # it came from the grammar compile against "tools", with the path the parameters were moved to
    # ("#/$defs/f/definitions/missing"), which the client never wrote
    with pytest.raises(InvalidRequest) as caught:
        plan_tools(body(tools=[WEATHER, _with_parameters(parameters)]), False)
    assert caught.value.field == "tools[1].function.parameters"
    assert f"$ref {ref!r} at {at} points at nothing" in caught.value.message
    assert "$defs/f" not in caught.value.message


def test_refs_that_resolve_and_refs_inside_values_pass() -> None:
    parameters = {
        "type": "object",
        "properties": {"a": {"$ref": "#/definitions/x"}, "b": {"const": {"$ref": "#/not/a/reference"}}},
        "definitions": {"x": {"type": "string"}},
    }
    assert plan_tools(body(tools=[_with_parameters(parameters)]), False) is not None


def test_tools_too_large_for_the_calls_schema_are_refused_before_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    # 34,000 tools without parameters: the calls' schema (6.6 M characters) was built, then measured
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the calls' schema was built")

    monkeypatch.setattr(tools_module, "_calls_grammar", never)
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(34_000)]
    with pytest.raises(GrammarError) as caught:
        plan_tools(body(tools=many), False, max_schema_chars=256 * 1024)
    assert caught.value.field == "tools" and "262,144" in caught.value.message
    # a named choice builds only its own function's schema: that one is measured
    named = {"type": "function", "function": {"name": "f7"}}
    with pytest.raises(AssertionError, match="was built"):
        plan_tools(body(tools=many, tool_choice=named), False, max_schema_chars=256 * 1024)


def test_duplicate_names_are_found_among_many() -> None:
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5_000)]
    with pytest.raises(InvalidRequest) as caught:
        plan_tools(body(tools=[*many, {"type": "function", "function": {"name": "f123"}}]), False)
    assert caught.value.field == "tools[5000].function.name"
