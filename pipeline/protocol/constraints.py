"""Structured-output constraints in every spelling clients bring.

A request written for another server must never come back 200 with unconstrained text because
we did not know its field (rule 7 of the README). So ``parse_constraint(body)`` reads every
constraint spelling below into one ``GrammarSpec`` whose ``field`` says exactly where the
constraint came from, and refuses (400) a request that carries two constraints, whatever their
spellings. A top-level field that no body type declares is refused (400, OpenAI's wording) where
the body is decoded (``pipeline.protocol.request_bodies``, ``pipeline.protocol.wire``).

Spellings; the spec's ``field`` is the spelling itself unless given in brackets::

    spelling                                                 origin     kind
    -------------------------------------------------------  ---------  ----------------------------
    response_format {"type": "text"}                         OpenAI     (no constraint)
    response_format {"type": "json_object"}                  OpenAI     json_object [response_format]
    response_format {"type": "json_schema",                  OpenAI     json_schema
                     "json_schema": {"schema": S, ...}}                   [response_format.json_schema.schema]
    response_format {"type": "json_schema", "schema": S}     SGLang     json_schema [response_format.schema]
    response_format {"type": "json_object", "schema": S}     Fireworks  json_schema [response_format.schema]
    response_format {"type": "structural_tag", "format": F}  xgrammar   structural_tag [response_format]
    response_format {"type": "structural_tag",               vLLM,      structural_tag [response_format]
                     "structures": [...], "triggers": [...]} SGLang
    structured_outputs.json           (S or a JSON string)   vLLM       json_schema
    structured_outputs.regex                                 vLLM       regex
    structured_outputs.choice                                vLLM       choice
    structured_outputs.grammar                               vLLM       grammar
    structured_outputs.json_object    (true)                 vLLM       json_object
    structured_outputs.structural_tag (JSON string or obj)   vLLM       structural_tag
    guided_json                       (S or a JSON string)   old vLLM   json_schema
    guided_regex                                             old vLLM   regex
    guided_choice                                            old vLLM   choice
    guided_grammar                                           old vLLM   grammar
    structural_tag                    (JSON string or obj)   old vLLM   structural_tag
    json_schema                       (S or a JSON string)   SGLang     json_schema
    regex                                                    SGLang, us regex
    ebnf                                                     SGLang     grammar
    grammar                                                  us         grammar
    choice                                                   us         choice

A JSON schema ``S`` is an object or a boolean, or a string holding one. ``strict`` is True except
where ``response_format.json_schema.strict`` says false. A field whose value is ``null`` is absent.

Options that come with those spellings and what we do with them:

* ``structured_outputs.disable_any_whitespace``: accepted and ignored. We compile JSON grammars
  without free whitespace anyway; ``false`` (allow any whitespace) only widens what is allowed,
  and an answer without free whitespace satisfies it.
* ``structured_outputs.disable_additional_properties``: accepted. ``strict=True`` (the spec's
  default on every vLLM spelling) already forbids properties the schema does not name.
* ``structured_outputs.backend`` / ``disable_fallback`` and top-level ``guided_decoding_backend``:
  accepted and ignored. Which grammar engine runs is ours to choose; every answer is checked
  against the whole constraint whichever engine made it.
* ``structured_outputs.whitespace_pattern`` / ``guided_whitespace_pattern``: refused (400). It
  says what whitespace between JSON tokens must look like; xgrammar cannot take it, and ignoring
  it could return an answer the caller's pattern rejects.

A structural tag, in any of its spellings, is checked and normalized by
``pipeline.protocol.structural_tags``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from pipeline.errors import InvalidRequest
from pipeline.protocol.json_fields import (
    as_boolean,
    as_schema,
    as_string,
    as_strings,
    field_error,
    json_text,
    only_keys,
)
from pipeline.protocol.structural_tags import structural_tag
from pipeline.types import GrammarKind, GrammarSpec

__all__ = ["CONSTRAINT_FIELDS", "parse_constraint"]


# -- the simple kinds -----------------------------------------------------------------------------------
def _json_schema_spec(value: Any, field: str) -> GrammarSpec:
    return GrammarSpec("json_schema", as_schema(value, field), field=field)


def _string_spec(kind: GrammarKind, value: Any, field: str) -> GrammarSpec:
    return GrammarSpec(kind, as_string(value, field, non_empty=True), field=field)


def _choice_spec(value: Any, field: str) -> GrammarSpec:
    return GrammarSpec("choice", as_strings(value, field, non_empty_list=True, non_empty_items=True), field=field)


def _json_object_spec(value: Any, field: str) -> GrammarSpec:
    # vLLM counts any non-null json_object as the constraint; only ``true`` has a clear meaning.
    if value is not True:
        raise field_error(f"'{field}' must be true (leave it out for no constraint)", field)
    return GrammarSpec("json_object", None, field=field)


def _structural_tag_spec(value: Any, field: str) -> GrammarSpec:
    # vLLM's ``structural_tag`` fields are JSON strings; objects are accepted too.
    if isinstance(value, str):
        value = json_text(value, field)
    return GrammarSpec("structural_tag", structural_tag(value, field), field=field)


# -- response_format ------------------------------------------------------------------------------------
def _response_format(raw: Any) -> GrammarSpec | None:
    where = "response_format"
    if not isinstance(raw, dict):
        raise field_error("'response_format' must be an object", where)
    kind = raw.get("type")
    if kind == "text":
        only_keys(raw, ("type",), where)
        return None
    if kind == "json_object":
        if raw.get("schema") is not None:  # Fireworks' and Together's spelling of a schema
            only_keys(raw, ("type", "schema"), where)
            return _json_schema_spec(raw["schema"], "response_format.schema")
        only_keys(raw, ("type",), where)
        return GrammarSpec("json_object", None, field=where)
    if kind == "json_schema":
        only_keys(raw, ("type", "json_schema", "schema"), where)
        spec, shortcut = raw.get("json_schema"), raw.get("schema")
        if shortcut is not None:  # SGLang's shortcut: the schema right under response_format
            if spec is not None:
                raise field_error(
                    "give the schema once: response_format.json_schema.schema or response_format.schema",
                    "response_format.schema",
                )
            return _json_schema_spec(shortcut, "response_format.schema")
        where = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise field_error("'response_format.json_schema' must be an object", where)
        only_keys(spec, ("name", "description", "schema", "strict"), where)
        # OpenAI requires ``name``; it labels the schema and constrains nothing, so it may be left out.
        # ``description`` is a hint to the model; the answer must satisfy the schema either way.
        for key in ("name", "description"):
            if spec.get(key) is not None:
                as_string(spec[key], f"{where}.{key}")
        if spec.get("schema") is None:
            raise field_error("'response_format.json_schema.schema' is required", f"{where}.schema")
        schema = as_schema(spec["schema"], f"{where}.schema")
        strict = spec.get("strict")
        strict = True if strict is None else as_boolean(strict, f"{where}.strict")
        return GrammarSpec("json_schema", schema, strict=strict, field=f"{where}.schema")
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", structural_tag(raw, where), field=where)
    raise field_error(
        f"unknown response_format type {kind!r} (expected text, json_object, json_schema or structural_tag)",
        "response_format.type",
    )


# -- vLLM's structured_outputs ----------------------------------------------------------------------------
_Parser = Callable[[Any, str], GrammarSpec]
_STRUCTURED_OUTPUTS: dict[str, _Parser] = {
    "json": _json_schema_spec,
    "regex": partial(_string_spec, "regex"),
    "choice": _choice_spec,
    "grammar": partial(_string_spec, "grammar"),
    "json_object": _json_object_spec,
    "structural_tag": _structural_tag_spec,
}


def _whitespace_pattern(value: Any, field: str) -> None:
    if value is not None:
        raise field_error(
            f"'{field}' is not supported: JSON is generated without free whitespace; leave it out",
            field,
        )


# Options that change nothing the answer must satisfy (see the module docstring), with their type.
_STRUCTURED_OUTPUTS_OPTIONS: dict[str, Callable[[Any, str], object]] = {
    "disable_any_whitespace": as_boolean,
    "disable_additional_properties": as_boolean,
    "whitespace_pattern": _whitespace_pattern,
    "backend": as_string,
    "disable_fallback": as_boolean,
}


def _structured_outputs(raw: Any) -> GrammarSpec:
    where = "structured_outputs"
    if not isinstance(raw, dict):
        raise field_error("'structured_outputs' must be an object", where)
    found: list[GrammarSpec] = []
    for key, value in raw.items():
        field = f"{where}.{key}"
        if value is None:
            continue
        if key in _STRUCTURED_OUTPUTS:
            spec = _STRUCTURED_OUTPUTS[key](value, field)
            if found:
                raise _two_constraints(found[0], spec)
            found.append(spec)
        elif key in _STRUCTURED_OUTPUTS_OPTIONS:
            _STRUCTURED_OUTPUTS_OPTIONS[key](value, field)
        else:
            known = (*_STRUCTURED_OUTPUTS, *_STRUCTURED_OUTPUTS_OPTIONS)
            raise field_error(f"unknown key {key!r} in structured_outputs (expected {', '.join(known)})", field)
    if not found:
        raise field_error(f"'structured_outputs' needs exactly one of {', '.join(_STRUCTURED_OUTPUTS)}", where)
    return found[0]


# -- the whole body ------------------------------------------------------------------------------------
def _guided_decoding_backend(value: Any) -> None:
    as_string(value, "guided_decoding_backend")  # which engine runs is ours to choose; see the docstring


def _guided_whitespace_pattern(value: Any) -> None:
    _whitespace_pattern(value, "guided_whitespace_pattern")


_TOP_LEVEL: dict[str, Callable[[Any], GrammarSpec | None]] = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": partial(_json_schema_spec, field="guided_json"),
    "guided_regex": partial(_string_spec, "regex", field="guided_regex"),
    "guided_choice": partial(_choice_spec, field="guided_choice"),
    "guided_grammar": partial(_string_spec, "grammar", field="guided_grammar"),
    "guided_decoding_backend": _guided_decoding_backend,
    "guided_whitespace_pattern": _guided_whitespace_pattern,
    "structural_tag": partial(_structural_tag_spec, field="structural_tag"),
    "json_schema": partial(_json_schema_spec, field="json_schema"),
    "regex": partial(_string_spec, "regex", field="regex"),
    "ebnf": partial(_string_spec, "grammar", field="ebnf"),
    "grammar": partial(_string_spec, "grammar", field="grammar"),
    "choice": partial(_choice_spec, field="choice"),
}

#: Top-level fields ``parse_constraint`` reads (constraints and their options).
CONSTRAINT_FIELDS: frozenset[str] = frozenset(_TOP_LEVEL)


def _two_constraints(first: GrammarSpec, second: GrammarSpec) -> InvalidRequest:
    return field_error(
        f"give at most one structured-output constraint; got {first.field} and {second.field}",
        second.field,
    )


def parse_constraint(body: dict[str, Any]) -> GrammarSpec | None:
    """The request's one structured-output constraint, in whichever spelling it came (module docstring).

    :raises InvalidRequest: a constraint of the wrong shape (naming its field), an unsupported option,
        or two constraints (naming the second, in body order, and listing both).
    """
    if not isinstance(body, dict):
        raise field_error("the request body must be a JSON object", "body")
    found: GrammarSpec | None = None
    for name, value in body.items():
        parser = _TOP_LEVEL.get(name)
        if parser is None or value is None:
            continue
        spec = parser(value)
        if spec is None:
            continue
        if found is not None:
            raise _two_constraints(found, spec)
        found = spec
    return found
