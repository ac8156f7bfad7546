"""Tool calling: ``tools`` and ``tool_choice`` into a constraint on the model's calls, and back.

The model writes its calls in its chat template's own format (``tool_formats``: Mistral's
``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, Hermes' ``<tool_call>`` tags, Llama 3's
JSON object); described here for Mistral's. What each ``tool_choice`` asks of it:

- ``none`` (or no tools): no constraint, and the marker is banned, so the answer is text.
- ``required``: the marker is put at the end of the prompt (the assistant's turn starts with it)
  and the rest must be a non-empty array of calls, each one's arguments under its function's
  JSON schema (``anyOf`` over the functions).
- a named function: the same, with one call to that function alone.
- ``auto`` (the default with tools): free text until the model writes the marker; from that token
  on the same array of calls is enforced (the engine's grammar trigger). A family whose marker is
  several tokens, or that has none (Llama 3), gets a grammar over the whole answer instead
  (``ToolFormat.answer_grammar``), and the calls are found in the text (``spans_answer``).

The calls are a JSON-schema constraint like any other: compiled by the grammar stage, and each
finished call array is checked against the whole schema before it leaves (rule 7). Call ids are 9
characters (the Mistral template refuses others); ids a client sends back that are not are mapped
to 9 characters the same way every time, so a conversation's calls and results still match.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.errors import GrammarError, InvalidRequest
from pipeline.protocol.request_bodies import ChatCompletionRequest, NamedToolChoice, Tool
from pipeline.protocol.tool_formats import FORMATS, ToolFormat
from pipeline.protocol.wire import check_depth
from pipeline.types import GrammarSpec
from stages.grammar.empty_schemas import empty_schema_reason
from stages.grammar.local_refs import dangling_local_ref

__all__ = ["ToolPlan", "new_call_id", "plan_tools", "template_call_id"]

_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 9
# a function without parameters takes exactly {}: a free-form object lets a weak model ramble
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of the template, the engine and the response."""

    mode: ToolMode
    tools: tuple[dict[str, Any], ...]  # OpenAI's tool objects, for the chat template
    grammar: GrammarSpec  # the calls the model writes after the marker, in its family's syntax
    format: ToolFormat = FORMATS["mistral"]
    # spans_answer: one call's JSON schema, each call in the answer is checked against (the
    # grammar's own check of the whole answer is its engine's acceptor)
    call_schema: dict[str, Any] | None = None

    @property
    def starts_with_call(self) -> bool:
        """Whether the answer is calls from its first token (the marker ends the prompt)."""
        return self.mode != "auto"

    @property
    def spans_answer(self) -> bool:
        """Whether the grammar covers the whole answer, text and calls (``auto`` without a marker token)."""
        return self.mode == "auto" and not self.format.triggers_by_token


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, stage="admission")


def _call_schema(name: str, arguments: dict[str, Any], key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _has_local_ref(value: Any) -> bool:
    if isinstance(value, dict):
        ref = value.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in value.values())
    return isinstance(value, list) and any(_has_local_ref(v) for v in value)


def _rebased(value: Any, prefix: str) -> Any:
    """``value`` with every local ``$ref`` (``#/definitions/x``, ``#``) pointing under ``prefix``."""
    if isinstance(value, dict):
        return {
            k: prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, prefix)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_rebased(v, prefix) for v in value]
    return value


def _calls_grammar(
    functions: list[tuple[str, dict[str, Any] | None]], fmt: ToolFormat, *, single: bool, whole: bool
) -> tuple[GrammarSpec, dict[str, Any]]:
    """The calls in ``fmt``'s syntax (``whole``: the whole answer, text or calls). A function's
    parameters with local ``$ref``s (``#/definitions/x`` means its own root) move under ``$defs`` of
    the schema's root, their refs re-pointed there. With it, one call's schema."""
    defs: dict[str, Any] = {}
    calls = []
    for name, parameters in functions:
        arguments = parameters if parameters is not None else _NO_PARAMETERS
        if "type" not in arguments:
            # OpenAI's arguments are an object: a schema that leaves the type open ({}) let the
            # model write a number there
            arguments = {**arguments, "type": "object"}
        if _has_local_ref(arguments):
            # an $id would make its refs resolve against another base than the one they are moved to
            moved = {k: v for k, v in arguments.items() if k not in ("$id", "$schema")}
            defs[name] = _rebased(moved, f"#/$defs/{name}")
            arguments = {"$ref": f"#/$defs/{name}"}
        calls.append(_call_schema(name, arguments, fmt.arguments_key))
    one = fmt.call_schema(calls)
    return (fmt.answer_grammar if whole else fmt.grammar)(calls, defs, single=single), (
        {**one, "$defs": defs} if defs else one
    )


def _check_names(tools: list[Tool]) -> None:
    """:raises InvalidRequest: naming the second of two tools with one name (one pass: a set)."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise _fail(f"two tools are named {name!r}", f"tools[{i}].function.name")
        seen.add(name)


def _check_parameters(parameters: dict[str, Any], where: str) -> None:
    """:raises InvalidRequest: naming ``where`` for parameters that are not an object schema, nest too
    deep, admit no value, or hold a local ``$ref`` to nothing."""
    if parameters.get("type", "object") != "object":
        raise _fail("a function's parameters must be an object schema", where)
    check_depth(parameters, where)  # before the recursive walks below
    reason = empty_schema_reason(parameters)
    if reason is not None:
        # checked here, on the function's own schema: inside the call array the grammar's first mask
        # allows "[", and the dead end came mid-answer as a 500
        raise _fail(f"the parameters admit no value: {reason}", where)
    dangling = dangling_local_ref(parameters)
    if dangling is not None:
        # here, before the parameters move under the calls schema's $defs: the compiler would name
        # the moved path (#/$defs/f/...), which the client never wrote
        at, ref = dangling
        raise _fail(f"the $ref {ref!r} at {at} points at nothing in the parameters", where)


def _check_calls_size(functions: list[tuple[str, dict[str, Any] | None]], max_chars: int) -> None:
    """Refuse the calls' grammar on the size of the parameters it would hold, before building it.

    Every function's parameters (less a top-level ``$id`` or ``$schema``, which may be dropped) appear
    in the calls schema, so their JSON together is a lower bound on the schema's own: past
    ``max_chars``, the schema is certainly past the grammar stage's limit on it.

    :raises GrammarError: naming ``tools``.
    """
    total = 0
    for name, parameters in functions:
        kept = {k: v for k, v in (parameters or _NO_PARAMETERS).items() if k not in ("$id", "$schema")}
        total += len(name) + len(json.dumps(kept, separators=(",", ":"), ensure_ascii=False))
        if total > max_chars:
            raise GrammarError(
                f"the tools are too large: their parameters alone are more than {max_chars:,} characters of JSON, "
                f"the limit on the calls' schema",
                field="tools",
                stage="admission",
            )


def plan_tools(
    body: ChatCompletionRequest,
    has_other_constraint: bool,
    fmt: ToolFormat = FORMATS["mistral"],
    *,
    max_schema_chars: int | None = None,
) -> ToolPlan | None:
    """The plan for ``body``'s tools in the model's call format ``fmt``; None when the answer is plain
    text (no tools, or ``none``). ``max_schema_chars``: the grammar stage's limit on a schema's JSON,
    checked on the parameters before the calls' schema is built (None: left to the grammar stage).

    :raises InvalidRequest: a choice naming an unknown function, duplicate names, parameters nested
        too deep or with a ``$ref`` to nothing, tool_choice without tools, or tools beside another
        structured-output constraint. :raises GrammarError: parameters too large for the calls' schema.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise _fail("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if choice == "none":
        return None
    _check_names(body.tools)
    for i, tool in enumerate(body.tools):
        if tool.function.parameters is not None:
            _check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
    if has_other_constraint:
        raise _fail("tools cannot be combined with another structured-output constraint", "tool_choice")
    functions = [(tool.function.name, tool.function.parameters) for tool in body.tools]
    mode: ToolMode = "auto" if choice in (None, "auto") else "required"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {name for name, _ in functions}:
            raise _fail(f"no tool is named {choice.function.name!r}", "tool_choice.function.name")
        functions = [f for f in functions if f[0] == choice.function.name]
        mode = "named"
    if max_schema_chars is not None:
        _check_calls_size(functions, max_schema_chars)
    single = mode == "named" or body.parallel_tool_calls is False
    whole = mode == "auto" and not fmt.triggers_by_token
    grammar, call_schema = _calls_grammar(functions, fmt, single=single, whole=whole)
    tools = tuple(_tool_json(tool.function) for tool in body.tools)
    return ToolPlan(mode, tools, grammar, fmt, call_schema if whole else None)


def _tool_json(function: Any) -> dict[str, Any]:
    described = {"name": function.name}
    if function.description is not None:
        described["description"] = function.description
    described["parameters"] = function.parameters if function.parameters is not None else _NO_PARAMETERS
    return {"type": "function", "function": described}


def new_call_id() -> str:
    """A fresh tool-call id: 9 letters and digits, as the Mistral template requires."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(_ID_LENGTH))


def template_call_id(call_id: str) -> str:
    """``call_id`` as the template takes it: itself when it is 9 letters and digits, else a stable
    9-character digest of it (a call and its result map to the same one)."""
    if len(call_id) == _ID_LENGTH and all(c in _ALPHABET for c in call_id):
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    chars = []
    for _ in range(_ID_LENGTH):
        digest, rest = divmod(digest, len(_ALPHABET))
        chars.append(_ALPHABET[rest])
    return "".join(chars)
