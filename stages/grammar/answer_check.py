"""The answer check: the last gate of a structured answer before it leaves with finish_reason "stop".

Rule 7 of the README: no grammar engine is trusted to be complete. Measured on xgrammar 0.2.8 (non-strict schemas), the
grammar lets through duplicate keys, ``maxLength`` beside a ``pattern``, ``multipleOf``, format details (ipv4
``01.2.3.4``, date ``0053-02-30``), lone-surrogate escapes (``"\\ud800"``) and numbers past a double (``1e400``),
and its regex ``.`` matches a newline. So every answer is parsed strictly and checked against the whole
constraint here, once per finished answer, on the event loop: it must be cheap.

JSON validator, chosen by measurement on the 220 JSONSchemaBench schemas (1,004 instances, 2-core dev box)::

    validator               built  build p50 / p99 / max    validate p50 / p99     disagree  formats
    jsonschema_rs 0.60.3    220    0.06 / 3-4.5 / 4.9 ms     0.5-0.9 / 10-15 us     2 (*)     every standard one
    fastjsonschema 2.22.3   219    1.2-2.3 / 33-170 / 238 ms 3.4-4.4 / 125-345 us   2 (*)     no uuid
    jsonschema 4.26.0       220    0.02 / 0.13 / 0.3 ms      37 / 1,970-2,180 us    15        no date-time/uri/hostname

(*) "uuid" in a draft-06 schema, not a draft-06 format: we assert every standard format in every draft
(``_added_formats``), and then all 1,004 labels agree. fastjsonschema also fails on a pattern Python's ``re``
rejects, writes defaults into the instance it validates unless ``use_default=False``, and cannot build ``const``
with ``detailed_exceptions=False``. A whole check of a corpus answer (parse + validate) costs p50 7 us, p99 0.11
ms; 10 of the 220 schemas take 1-2.7 ms to build (a big regex up to 20 ms), so the caller builds the check in the
grammar compile thread and caches it beside the compiled grammar.

The ``regex`` kind runs on the engine that checks ``pattern`` (Rust regex via jsonschema_rs): ECMA-262 classes
(``\\d`` is ASCII, as in xgrammar), ``\\p{L}`` and ``\\cA`` understood, and linear time. Python's ``re`` is
Unicode-minded, lacks those escapes, and backtracks: ``(a+)+b`` against 28 ``a`` took 9.9 s on the loop.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol

import jsonschema_rs
import xgrammar as xgr

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec

__all__ = ["AnswerCheck", "JsonCheck", "MatchCheck", "Violation", "build_answer_check", "xgrammar_acceptor"]

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: a pair is decoded to one character
_MAX_MESSAGE = 200  # a message quotes the offending value, which may be a whole object
_ACCEPTOR_KINDS = frozenset({"grammar", "structural_tag"})
# Standard formats (2020-12) and those each older draft defines. jsonschema_rs asserts a format only from the
# draft that introduced it; we assert every standard one whatever the draft, as the grammar enforces them.
_STANDARD_FORMATS = (
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
)  # fmt: skip
_DRAFT4_FORMATS = frozenset({"date-time", "email", "hostname", "ipv4", "ipv6", "uri"})
_DRAFT6_FORMATS = _DRAFT4_FORMATS | {"uri-reference", "uri-template", "json-pointer"}
_DRAFT7_FORMATS = _DRAFT6_FORMATS | {
    "date", "time", "idn-email", "idn-hostname", "iri", "iri-reference", "relative-json-pointer", "regex",
}  # fmt: skip
_DRAFT_FORMATS: dict[type[jsonschema_rs.Validator], frozenset[str]] = {
    jsonschema_rs.Draft4Validator: _DRAFT4_FORMATS,
    jsonschema_rs.Draft6Validator: _DRAFT6_FORMATS,
    jsonschema_rs.Draft7Validator: _DRAFT7_FORMATS,
}


@dataclass(frozen=True, slots=True)
class Violation:
    path: str  # JSON pointer into the answer ("/items/2/name", "" for the root); "" for regex, choice, grammar
    message: str
    reason: str = field(
        default="", compare=False
    )  # what failed, for metrics: "json", a schema keyword ("maxLength"), "regex", "choice", ...


class AnswerCheck(Protocol):
    def check(self, text: str) -> Violation | None:
        """None when ``text`` satisfies the whole constraint, else the first violation found."""
        ...


class _NotJson(ValueError):
    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message, self.path = message, path


class _DuplicateKey(_NotJson):
    pass


class _Duplicated(dict[str, Any]):
    """An object with a repeated key, made only by the second parse that locates it."""

    key: str = ""


class JsonCheck:
    """Strict parse (no NaN/Infinity, no duplicate keys, finite numbers), then the whole schema."""

    __slots__ = ("_validator",)

    def __init__(self, validator: jsonschema_rs.Validator) -> None:
        self._validator = validator

    def check(self, text: str) -> Violation | None:
        try:
            value = _loads_strict(text)
        except _NotJson as exc:
            return Violation(exc.path, exc.message, "json")
        if _has_lone_surrogate(text, value):  # cannot be sent as UTF-8, nor cross into Rust (it raises there)
            return Violation("", 'a string holds an unpaired surrogate (such as "\\ud800")', "json")
        if self._validator.is_valid(value):
            return None
        error = next(iter(self._validator.iter_errors(value)), None)
        if error is None:
            return Violation("", "the answer does not satisfy the schema", "schema")
        keyword = str(error.schema_path[-1]) if error.schema_path else "schema"
        return Violation(_pointer(error.instance_path), _shorten(error.message), keyword)


class MatchCheck:
    """The whole text matches (a regex, one of the choices, a grammar)."""

    __slots__ = ("_matches", "_message", "_reason")

    def __init__(self, matches: Callable[[str], bool], message: str, reason: str) -> None:
        self._matches, self._message, self._reason = matches, message, reason

    def check(self, text: str) -> Violation | None:
        return None if self._matches(text) else Violation("", self._message, self._reason)


def build_answer_check(spec: GrammarSpec, *, grammar_acceptor: Callable[[str], bool] | None = None) -> AnswerCheck:
    """The check of every answer under ``spec``; build it once, beside the compiled grammar (up to ms).

    :raises GrammarError: naming ``spec.field`` when the constraint cannot be checked (invalid schema, a regex
        no engine here can run and no ``grammar_acceptor``).
    :raises ValueError: a grammar or structural tag without ``grammar_acceptor`` (a caller's bug).
    """
    kind: str = spec.kind
    if kind == "json_schema":
        return JsonCheck(_schema_validator(spec.value, spec.field))
    if kind == "json_object":
        return JsonCheck(_schema_validator({"type": "object"}, spec.field))
    if kind == "regex":
        return MatchCheck(
            _regex_matcher(spec, grammar_acceptor), "the answer does not match the regex as a whole", "regex"
        )
    if kind == "choice":
        if not isinstance(spec.value, list) or not all(isinstance(c, str) for c in spec.value):
            raise GrammarError("the choices must be a list of strings", field=spec.field)
        return MatchCheck(
            frozenset(spec.value).__contains__, f"the answer is not one of the {len(spec.value)} choices", "choice"
        )
    if kind in _ACCEPTOR_KINDS:
        if grammar_acceptor is None:
            raise ValueError(f"checking a {kind} needs the grammar_acceptor of its compiled grammar")
        return MatchCheck(grammar_acceptor, f"the answer is not a complete match of the {kind.replace('_', ' ')}", kind)
    raise GrammarError(f"unknown constraint kind {kind!r}", field=spec.field)


def xgrammar_acceptor(compiled_grammar: xgr.CompiledGrammar) -> Callable[[str], bool]:
    """Whether a whole text is a complete sentence of ``compiled_grammar``.

    A fresh matcher per call, so the decode-time matcher's state (and any slip in how it was advanced) plays no
    part; it checks the text, not the token ids, so it needs no stop token either.
    """

    def accepts(text: str) -> bool:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # a raw surrogate: not text a client can be sent (xgrammar would raise)
            return False
        # terminate_without_stop_token: the grammar may end where the text ends; is_completed() says it does
        matcher = xgr.GrammarMatcher(compiled_grammar, terminate_without_stop_token=True)
        return bool(matcher.accept_string(data)) and bool(matcher.is_completed())

    return accepts


# -- JSON --------------------------------------------------------------------------------------------
def _schema_validator(schema: Any, field: str) -> jsonschema_rs.Validator:
    if not isinstance(schema, dict | bool):
        raise GrammarError("the schema must be a JSON object or a boolean", field=field)
    try:
        # validator_cls_for reads $schema (no $schema: 2020-12); the class also checks the schema against its
        # meta-schema, so a schema the grammar engine half-understood is refused here, not half-checked
        cls = jsonschema_rs.validator_cls_for(schema)
        return cls(schema, validate_formats=True, formats=_added_formats(cls), retriever=_never_fetch)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        where = _pointer(getattr(exc, "instance_path", []))  # into the schema, for a meta-schema failure
        message = _shorten(getattr(exc, "message", None) or str(exc).strip().splitlines()[0], 120)
        at = f" at {where}" if where else ""
        raise GrammarError(f"the schema cannot be checked{at}: {message}", field=field) from None


def _never_fetch(uri: str) -> dict[str, Any]:
    # A remote $ref is never fetched (no network, and no request may make us fetch): it accepts any value, as the
    # grammar treats it. A strict schema with one is refused before this (stages.grammar.schema_support).
    return {}


@cache
def _format_check(name: str) -> Callable[[Any], bool]:
    return jsonschema_rs.Draft202012Validator({"format": name}, validate_formats=True).is_valid


def _added_formats(cls: type[jsonschema_rs.Validator]) -> dict[str, Callable[[Any], bool]] | None:
    defined = _DRAFT_FORMATS.get(cls)
    if defined is None:
        return None  # 2019-09 and 2020-12 define every standard format
    return {name: _format_check(name) for name in _STANDARD_FORMATS if name not in defined}


def _reject_constant(name: str) -> Any:
    raise _NotJson(f"not valid JSON: {name} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):  # a client would read it as Infinity (and jsonschema_rs as null)
        raise _NotJson(f"the number {_shorten(literal, 40)} is beyond the range of a double")
    return value


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey("duplicate key")  # located by a second parse, off the fast path
    return obj


def _mark_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked, seen = _Duplicated(obj), set()
    for key, _ in pairs:
        if key in seen:
            marked.key = key
            break
        seen.add(key)
    return marked


def _loads_strict(text: str, pairs_hook: Callable[[list[tuple[str, Any]]], Any] = _unique_pairs) -> Any:
    try:
        return json.loads(
            text, object_pairs_hook=pairs_hook, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except _DuplicateKey:
        raise _locate_duplicate(_loads_strict(text, _mark_duplicates)) from None
    except _NotJson:
        raise
    except json.JSONDecodeError as exc:  # json.loads is strict: a raw control character in a string is refused
        raise _NotJson(f"not valid JSON at char {exc.pos}: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:  # an integer over 4,300 digits; nesting deeper than the stack
        raise _NotJson(f"not valid JSON: {_shorten(str(exc), 80)}") from None


def _has_lone_surrogate(text: str, value: Any) -> bool:
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):  # rare: only then look at the decoded strings
        return not _is_utf8(json.dumps(value, ensure_ascii=False))
    return not text.isascii() and not _is_utf8(text)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _locate_duplicate(value: Any) -> _NotJson:
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:  # depth first in document order, without recursion (the answer may nest deep)
        path, node = stack.pop()
        if isinstance(node, _Duplicated):
            return _NotJson(f"duplicate key {_shorten(json.dumps(node.key), 60)}", f"{path}/{_escape(node.key)}")
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend(reversed([(f"{path}/{_escape(str(key))}", child) for key, child in children]))
    return _NotJson("duplicate key")


# -- regex -------------------------------------------------------------------------------------------
def _regex_matcher(spec: GrammarSpec, grammar_acceptor: Callable[[str], bool] | None) -> Callable[[str], bool]:
    if not isinstance(spec.value, str):
        raise GrammarError("the regex must be a string", field=spec.field)
    try:
        # compiled alone first: then its groups balance, and the anchored wrapper cannot change its meaning
        jsonschema_rs.Draft202012Validator({"pattern": spec.value})
        # Rust's $ (no multiline flag) matches only at the very end: no trailing-newline allowance as in Python
        return jsonschema_rs.Draft202012Validator({"type": "string", "pattern": f"^(?:{spec.value})$"}).is_valid
    except jsonschema_rs.ValidationError as exc:
        if grammar_acceptor is not None:
            return grammar_acceptor  # ECMA syntax Rust lacks (\0, [\d-x]): the grammar's own matcher decides
        raise GrammarError(f"the regex cannot be checked: {_shorten(exc.message, 120)}", field=spec.field) from None


# -- helpers -----------------------------------------------------------------------------------------
def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _pointer(parts: list[str | int]) -> str:
    return "".join(f"/{_escape(str(part))}" for part in parts)


def _shorten(message: str, limit: int = _MAX_MESSAGE) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"
