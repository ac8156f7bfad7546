"""The model's call array, read as it streams, into OpenAI's tool-call pieces.

The text after the marker is ``[{"name": "f", "arguments": {...}}, ...]`` (Mistral's; Hermes writes
``{...}</tool_call>`` per call, Llama 3 one ``{"name": "f", "parameters": {...}}``: each call is an
object whatever is around it). The grammar enforces it, with ``name`` first as its schema lists it;
arguments are an object, though any JSON value is read whole. ``CallReader.feed`` takes the text in
any chunks and returns what became known: a call's start (its name) as soon as the name is complete,
then its arguments' text as it arrives, so a stream sends the name first and the arguments in
fragments, as OpenAI streams them. A whole answer read at once gives the same calls, so a streamed
and a non-streamed response agree; arguments are the model's own JSON text, never re-encoded.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field

__all__ = ["CallReader", "CallStart", "ParsedCall"]


def _head(key: str) -> re.Pattern[str]:
    """{"name": "NAME", "KEY": , with any JSON whitespace; NAME is a JSON string body."""
    return re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(key) + r'"\s*:\s*')


_HEADS = {key: _head(key) for key in ("arguments", "parameters")}


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's position in the answer
    name: str


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str = ""


def _name(escaped: str) -> str:
    """A JSON string body as text (the grammar makes it a valid one; raw if it somehow is not)."""
    try:
        return str(json.loads(f'"{escaped}"'))
    except json.JSONDecodeError:
        return escaped


class _State(enum.Enum):
    OUTSIDE = "outside"  # between calls
    HEAD = "head"  # inside {"name": ..., "arguments":
    BEFORE_ARGUMENTS = "before"  # the head is complete; whitespace until the arguments' value
    ARGUMENTS = "arguments"  # inside the arguments' value


@dataclass
class CallReader:
    """Reads one answer's calls incrementally (one reader per choice); ``arguments_key``: the key of
    a call's arguments (Llama 3 writes ``parameters``). Text between calls (Hermes' tags) is skipped."""

    arguments_key: str = "arguments"
    calls: list[ParsedCall] = field(default_factory=list)
    _state: _State = _State.OUTSIDE
    _head: str = ""
    _depth: int = 0  # nesting inside the arguments' value
    _in_string: bool = False
    _escaped: bool = False
    _is_scalar: bool = False  # the arguments' value is a number, true, false or null

    def feed(self, text: str) -> list[CallStart | tuple[int, str]]:
        """What ``text`` (the next chunk) made known: ``CallStart`` for a new call, ``(index,
        fragment)`` for more of its arguments' text."""
        events: list[CallStart | tuple[int, str]] = []
        fragment: list[str] = []
        for char in text:
            state = self._state
            if state is _State.OUTSIDE:
                if char == "{":
                    self._state, self._head = _State.HEAD, char
            elif state is _State.HEAD:
                self._head += char
                if (found := _HEADS[self.arguments_key].fullmatch(self._head)) is not None:
                    self.calls.append(ParsedCall(_name(found[1])))
                    events.append(CallStart(len(self.calls) - 1, self.calls[-1].name))
                    self._state = _State.BEFORE_ARGUMENTS
            elif state is _State.BEFORE_ARGUMENTS and char.isspace():
                continue
            elif self._ends_scalar(state, char):  # not part of the value: the call's ',' or '}'
                self._emit(events, fragment)
                fragment = []
                self._state, self._is_scalar = _State.OUTSIDE, False
            else:
                if state is _State.BEFORE_ARGUMENTS:
                    self._state, self._is_scalar = _State.ARGUMENTS, char not in '{["'
                fragment.append(char)
                self._scan(char)
                if self._depth == 0 and not self._in_string and not self._is_scalar:  # the value closed
                    self._emit(events, fragment)
                    fragment = []
                    self._state = _State.OUTSIDE
        self._emit(events, fragment)
        return events

    def _emit(self, events: list[CallStart | tuple[int, str]], fragment: list[str]) -> None:
        if fragment:
            text = "".join(fragment)
            self.calls[-1].arguments += text
            events.append((len(self.calls) - 1, text))

    def _ends_scalar(self, state: _State, char: str) -> bool:
        """Whether ``char`` ends a scalar value (the grammar asks for an object, but the reader
        takes any JSON value: a number, ``true``, ``false`` or ``null`` ends where they cannot go on)."""
        return state is _State.ARGUMENTS and self._is_scalar and (char in ",}]" or char.isspace())

    def _scan(self, char: str) -> None:
        """Track the arguments' nesting, strings and escapes."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
