"""Request bodies (bytes or Python objects) into ``pipeline.protocol.request_bodies`` types; every failure
a 400 that names the field.

The fast path is one msgspec decode of the bytes straight into the declared type. What it refuses
without naming a field is diagnosed on a slow path that only failures take: the body is parsed by
the standard library (which, unlike msgspec, reads lone UTF-16 surrogates such as ``"\\ud800"``,
so the string holding one can be named instead of the whole body), bytes that are not UTF-8 are
read as escaped surrogates so that the string or key holding them is named the same way, and
nesting too deep to parse is a 400 rather than a ``RecursionError``. Any unknown field is a 400,
even one set to null.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec

from pipeline.errors import InvalidRequest

__all__ = [
    "MAX_DEPTH",
    "MAX_SCHEMA_DEPTH",
    "check_depth",
    "check_tree",
    "decode_body",
    "loads_body",
    "validation_error",
]

T = TypeVar("T")

_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}
_SURROGATE = "the text holds a lone UTF-16 surrogate, which is not valid Unicode"
_NOT_UTF8 = "the text holds bytes that are not valid UTF-8"
MAX_DEPTH = 128  # nesting of a body given as Python objects (JSON bodies: the decoders' own limits)
# Nesting of a schema or other constraint value: the grammar compilers and the answer check walk it
# recursively (llguidance's JSON reader stops at 128 levels; Python's recursion near 1,000 frames), and
# real schemas nest a few dozen levels at most.
MAX_SCHEMA_DEPTH = 64


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, stage="admission")


def _field(path: str) -> str:
    return path.lstrip(".") or "body"


def _join(path: str, name: str) -> str:
    return f"{path.lstrip('.')}.{name}" if path else name


def validation_error(exc: msgspec.ValidationError) -> InvalidRequest:
    """msgspec's message (``Expected `int`, got `str` - at `$.n```) as a 400 naming the field."""
    found = _AT.match(str(exc))
    assert found is not None  # the pattern matches any text
    message, path = found["message"], found["path"] or ""
    if unknown := _UNKNOWN.match(message):
        name = unknown["name"]
        if not path:  # OpenAI's wording, which some clients match on to retry without the argument
            return _fail(f"Unrecognized request argument supplied: {name}", name)
        return _fail(f"unknown field '{name}'", _join(path, name))
    if missing := _MISSING.match(message):
        return _fail(f"'{missing['name']}' is required", _join(path, missing["name"]))
    return _fail(message, _field(path))


def check_tree(value: Any) -> InvalidRequest | None:
    """The error of the first string (key or value) holding a lone UTF-16 surrogate, or of the first
    value nested deeper than ``MAX_DEPTH``; None when there is neither.

    Iterative, so a deeply nested value cannot exhaust the stack. A lone surrogate cannot be encoded
    as UTF-8 (the tokenizer and the response writer would fail on it mid-request); a value nested
    thousands deep would exhaust the recursion of whatever reads it next (a grammar compiler).
    JSON bodies meet the same rules where they are decoded.
    """
    stack: list[tuple[str, int, Any]] = [("", 0, value)]
    while stack:
        path, depth, item = stack.pop()
        if depth > MAX_DEPTH:
            return _fail(f"the body is nested more than {MAX_DEPTH} deep", path or "body")
        if isinstance(item, str):
            if not item.isascii() and not _encodes(item):
                return _fail(_SURROGATE, path or "body")
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                where = _join(path, str(key))
                if isinstance(key, str) and not key.isascii() and not _encodes(key):
                    return _fail(_SURROGATE, where)
                stack.append((where, depth + 1, child))
        elif isinstance(item, list | tuple):
            stack.extend((f"{path}[{i}]", depth + 1, child) for i, child in reversed(list(enumerate(item))))
    return None


def check_depth(value: Any, field: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """Refuse ``value`` when its objects and arrays nest more than ``limit`` levels (iteratively, so
    any depth is measured without exhausting the stack).

    :raises InvalidRequest: naming ``field`` and the limit.
    """
    stack: list[tuple[int, Any]] = [(1, value)]
    while stack:
        depth, item = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is None:
            continue
        if depth > limit:
            raise _fail(f"'{field}' nests objects and arrays more than {limit} levels deep", field)
        stack.extend((depth + 1, child) for child in children)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def _parse(source: bytes | str) -> Any:
    try:
        return json.loads(source, parse_constant=_no_constant)
    except RecursionError:
        raise _fail("the body is nested too deeply", "body") from None
    except (json.JSONDecodeError, _NotJson) as exc:
        raise _fail(f"the body is not valid JSON: {exc}", "body") from None


def loads_body(raw: bytes) -> Any:
    """The standard library's parse of ``raw``. :raises InvalidRequest: naming ``body``, or the
    string or key that holds bytes that are not UTF-8."""
    try:
        return _parse(raw)
    except UnicodeDecodeError:
        pass
    # Each byte that is not UTF-8 becomes a lone surrogate (U+DC80..U+DCFF), which check_tree finds
    # in the string or key that holds it.
    error = check_tree(_parse(raw.decode("utf-8", "surrogateescape")))
    if error is None or error.message != _SURROGATE:
        raise _fail("the body is not UTF-8", "body")
    field = (error.field or "body").encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    raise _fail(_NOT_UTF8, field)


def _convert(obj: Any, kind: type[T]) -> T:
    if (error := check_tree(obj)) is not None:
        raise error
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise _fail("the body is nested too deeply", "body") from None


def decode_body(body: bytes | Any, kind: type[T]) -> T:
    """``body`` (JSON bytes, or an already parsed object) as a ``kind``.

    :raises InvalidRequest: naming the offending field (``body`` when it is not JSON at all).
    """
    if not isinstance(body, bytes | bytearray | memoryview):
        return _convert(body, kind)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        pass  # diagnosed below, where the standard library can say where and why
    return _convert(loads_body(bytes(body)), kind)
