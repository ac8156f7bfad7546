from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.errors import InvalidRequest
from pipeline.protocol.request import ImagePart, TextPart, parse_chat_request

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def body(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


def nested_schema(levels: int) -> dict[str, Any]:
    """An object schema ``levels`` objects deep (two JSON levels each: the schema and its properties)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_json(levels: int) -> str:
    """JSON text nesting objects ``levels`` deep: deeper than ``json.dumps`` or the stack could build."""
    return '{"a":' * levels + "1" + "}" * levels


def tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def test_parses_text_and_images_in_order() -> None:
    req = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE, IMAGE]},
            ],
            "max_tokens": 5,
            "temperature": 0,
            "seed": 7,
            "n": 2,
            "stop": "x",
        }
    )
    parts = req.messages[1].parts
    assert isinstance(parts[0], TextPart) and isinstance(parts[1], ImagePart)
    assert [im.index for im in req.images] == [0, 1]
    assert req.images[1].field == "messages[1].content[2].image_url.url"
    assert req.sampling.max_tokens == 5 and req.sampling.is_greedy and req.sampling.n == 2
    assert req.sampling.stop == ("x",)


def test_response_format_kinds() -> None:
    schema = {"type": "object"}
    spec = parse_chat_request(body(response_format={"type": "json_schema", "json_schema": {"schema": schema}})).grammar
    assert spec is not None and spec.kind == "json_schema" and spec.strict
    assert parse_chat_request(body(response_format={"type": "json_object"})).grammar.kind == "json_object"  # type: ignore[union-attr]
    assert parse_chat_request(body(response_format={"type": "text"})).grammar is None
    assert parse_chat_request(body(regex=r"\d+")).grammar.kind == "regex"  # type: ignore[union-attr]
    assert parse_chat_request(body(choice=["a", "b"])).grammar.value == ["a", "b"]  # type: ignore[union-attr]


def test_equal_schemas_share_a_cache_key() -> None:
    a = parse_chat_request(body(response_format={"type": "json_schema", "json_schema": {"schema": {"a": 1, "b": 2}}}))
    b = parse_chat_request(body(response_format={"type": "json_schema", "json_schema": {"schema": {"b": 2, "a": 1}}}))
    assert a.grammar is not None and b.grammar is not None and a.grammar.key == b.grammar.key


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ([], "body"),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "system", "content": [IMAGE]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [IMAGE] * 9}]}, "messages"),
        (body(max_tokens=-1), "max_tokens"),
        (body(max_tokens="5"), "max_tokens"),
        (body(max_completion_tokens=0), "max_completion_tokens"),
        (body(temperature=3), "temperature"),
        (body(temperature=float("nan")), "temperature"),
        (body(top_p=0), "top_p"),
        (body(n=0), "n"),
        (body(n=True), "n"),
        (body(stop=[""]), "stop[0]"),
        (body(stop=["a"] * 9), "stop"),
        (body(stream="yes"), "stream"),
        (body(response_format="json"), "response_format"),
        (body(response_format={"type": "yaml"}), "response_format.type"),
        (body(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (
            body(response_format={"type": "json_schema", "json_schema": {"schema": "{not json"}}),
            "response_format.json_schema.schema",
        ),
        (
            body(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
            "response_format.json_schema.schema",
        ),
        (
            body(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
            "response_format.json_schema.strict",
        ),
        (body(regex=""), "regex"),
        (body(choice=[]), "choice"),
        (body(choice=["a", 1]), "choice"),
        (body(regex="a", grammar='root ::= "a"'), "grammar"),
        (
            body(regex="a", response_format={"type": "json_object"}),
            "response_format",
        ),  # two constraints: the second in the body is named
        (body(ignore_eos=1), "ignore_eos"),
        (body(stream_options={"include_usage": True, "x": 1}), "stream_options.x"),
        (body(max_tokens=9000), "max_tokens"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
        (body(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools[1].function.name"),
        (body(tools=[{"type": "function", "function": {"name": "f g"}}]), "tools[0].function.name"),
        (body(tool_choice="required"), "tool_choice"),
        (body(logprobs=1), "logprobs"),
        (body(top_logprobs=21), "top_logprobs"),
        (body(top_logprobs=2), "top_logprobs"),
        (body(presence_penalty=2.5), "presence_penalty"),
        (body(frequency_penalty=-3), "frequency_penalty"),
        (body(logit_bias={"x": 10}), "logit_bias.x"),
        (body(logit_bias={"9" * 5_000: 1}), "logit_bias." + "9" * 29 + "..."),  # over int()'s digit limit
        (body(logit_bias={"9" * 20: 1}), "logit_bias." + "9" * 20),
        (body(tools=[tool(nested_schema(40))], tool_choice="required"), "tools[0].function.parameters"),
        (body(response_format=json_schema(nested_schema(40))), "response_format.json_schema.schema"),
        (body(guided_json=json.dumps(nested_schema(40))), "guided_json"),
        (body(seed=1 << 64), "seed"),
        (body(zeta=1), "zeta"),
    ],
)
def test_bad_input_names_the_field(bad: Any, field: str) -> None:
    # the same field is named whether the body arrives parsed (Python API) or as bytes (server);
    # NaN has no JSON spelling, so that body exists only as a Python object
    try:
        as_json = [json.dumps(bad, allow_nan=False).encode()]
    except ValueError:
        as_json = []
    for given in (bad, *as_json):
        with pytest.raises(InvalidRequest) as info:
            parse_chat_request(given, max_images=8)
        assert info.type is InvalidRequest and info.value.status == 400
        assert info.value.field == field
        assert info.value.stage == "admission"


@pytest.mark.parametrize(
    ("template", "field"),
    [
        (
            '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]',
            "tools[0].function.parameters",
        ),
        (
            '"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]',
            "tools[0].function.parameters",
        ),
        (
            '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": %s}}',
            "response_format.json_schema.schema",
        ),
        ('"guided_json": %s', "guided_json"),
    ],
)
@pytest.mark.parametrize("levels", [65, 900])
def test_a_schema_nested_too_deep_is_a_400_naming_it(template: str, field: str, levels: int) -> None:
    # 900 levels pass the JSON decoder and exhausted the recursion of whatever walked the schema next
    raw = '{"messages": [{"role": "user", "content": "hi"}], ' + template % nested_json(levels) + "}"
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(raw.encode())
    assert (info.value.status, info.value.field) == (400, field)
    assert "more than 64 levels deep" in info.value.message


@pytest.mark.parametrize("levels", [900, 3_000])
def test_a_schema_string_nested_too_deep_says_so(levels: int) -> None:
    raw = body(guided_json=nested_json(levels))
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(json.dumps(raw).encode())
    assert (info.value.status, info.value.field) == (400, "guided_json")
    assert "recursion" not in info.value.message and "deep" in info.value.message


def test_fields_at_their_defaults_pass() -> None:
    defaults = {"tools": [], "tool_choice": "none", "logprobs": False, "top_logprobs": 0, "presence_penalty": 0}
    raw = body(**defaults, frequency_penalty=0.0, logit_bias={})
    for given in (raw, json.dumps(raw).encode()):
        assert parse_chat_request(given).sampling.max_tokens == 256


def test_an_unknown_field_set_to_null_is_refused() -> None:
    raw = body(some_future_field=None)
    for given in (raw, json.dumps(raw).encode()):
        with pytest.raises(InvalidRequest) as info:
            parse_chat_request(given)
        assert info.value.field == "some_future_field"
        assert info.value.message == "Unrecognized request argument supplied: some_future_field"


def test_unknown_fields_use_openais_wording() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(json.dumps(body(best_of=2)).encode())
    assert info.type is InvalidRequest and info.value.field == "best_of"
    assert info.value.message == "Unrecognized request argument supplied: best_of"
