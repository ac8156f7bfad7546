"""How each model family writes tool calls: the constraint on its calls and how they read back.

A family's chat template tells the model one syntax for its calls (sampling/families.py names it):

- ``mistral``: the marker token ``[TOOL_CALLS]``, then ``[{"name": "f", "arguments": {...}}, ...]``.
- ``hermes`` (Qwen2, Qwen3): each call is ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``;
  the marker is ``<tool_call>`` (a special token in Qwen's tokenizers).
- ``llama3_json`` (Llama 3.1+): the answer is one ``{"name": "f", "parameters": {...}}`` object,
  with no marker (Llama 3.1's template allows a single call per turn).

For ``required`` and a named function the marker (if any) ends the prompt and the rest is the
constraint below. For ``auto`` the grammar holds from the marker token on where the marker is one
token of the tokenizer (no mask before it: free text costs nothing). Where it is several tokens, or
there is none, the grammar spans the whole answer instead (``answer_grammar``): free text or calls,
decided by the text, so the model cannot write a call that escapes its schema whichever tokens spell
it. Llama 3's answer is then either one call (it opens with ``{``) or text that does not open with
``{``: parsing the answer after the fact would pass a malformed or off-schema call on as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipeline.types import GrammarSpec

__all__ = ["FORMATS", "ToolFormat", "tool_format"]

FormatName = Literal["mistral", "hermes", "llama3_json"]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's call syntax."""

    name: FormatName
    marker: str | None  # the text that opens the calls (ends the prompt for required/named); None: none
    arguments_key: str  # the key of a call's arguments object
    many_calls: bool  # whether one answer may hold several calls
    end: str = ""  # the text that closes each call (hermes: </tool_call>)
    marker_is_token: bool = True  # the tokenizer writes the marker as one token (set at start)

    @property
    def triggers_by_token(self) -> bool:
        """Whether ``auto`` can start the grammar at the marker token (else it spans the answer)."""
        return self.marker is not None and self.marker_is_token

    def call_schema(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """One call: any of ``calls`` (each an object schema of a name and its arguments)."""
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def grammar(self, calls: list[dict[str, Any]], defs: dict[str, Any], *, single: bool) -> GrammarSpec:
        """The constraint on what follows the marker: ``calls`` are the per-function call schemas
        (their local refs point into ``defs``), ``single``: at most one call."""
        one = self.call_schema(calls)
        if self.name == "mistral":
            schema: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
            if single:
                schema["maxItems"] = 1
            return GrammarSpec("json_schema", _with_defs(schema, defs), field="tools")
        if single or not self.many_calls:
            # one JSON object: the grammar ends where it closes (the end tag is the template's, not ours)
            return GrammarSpec("json_schema", _with_defs(one, defs), field="tools")
        call = {"type": "json_schema", "json_schema": _with_defs(one, defs)}
        more = {"type": "tag", "begin": f"\n{self.marker}", "content": call, "end": self.end}
        seq = [call, {"type": "const_string", "value": self.end}, {"type": "star", "content": more}]
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": seq}}
        return GrammarSpec("structural_tag", tag, field="tools")

    def answer_grammar(self, calls: list[dict[str, Any]], defs: dict[str, Any], *, single: bool) -> GrammarSpec:
        """``auto`` without a marker token: the whole answer, free text or calls in this syntax."""
        call = {"type": "json_schema", "json_schema": _with_defs(self.call_schema(calls), defs)}
        if self.marker is None:
            # one call, or text that does not open like one (an empty answer is text too)
            text = {"type": "regex", "pattern": r"([^{][\s\S]*)?"}
            fmt: dict[str, Any] = {"type": "or", "elements": [call, text]}
        else:
            # Mistral's marker opens one array of every call; Hermes' each call
            calls_after = self.grammar(calls, defs, single=single).value if self.name == "mistral" else None
            content = call if calls_after is None else {"type": "json_schema", "json_schema": calls_after}
            tag = {"type": "tag", "begin": self.marker, "content": content, "end": self.end}
            fmt = {
                "type": "triggered_tags",
                "triggers": [self.marker],
                "tags": [tag],
                "at_least_one": False,
                "stop_after_first": single or not self.many_calls or calls_after is not None,
            }
        return GrammarSpec("structural_tag", {"type": "structural_tag", "format": fmt}, field="tools")


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


FORMATS: dict[str, ToolFormat] = {
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "arguments", many_calls=True),
    "hermes": ToolFormat("hermes", "<tool_call>", "arguments", many_calls=True, end="</tool_call>"),
    "llama3_json": ToolFormat("llama3_json", None, "parameters", many_calls=False),
}


def tool_format(name: str | None) -> ToolFormat:
    """The format called ``name``; a family that names none writes Mistral's."""
    return FORMATS[name or "mistral"]
