"""Structured-output constraints in every spelling clients bring.

A request written for another server must never come back 200 with unconstrained text because
we did not know its field (rule 7 of the README). So ``parse_constraint(body)`` reads every
constraint spelling below into one ``GrammarSpec`` whose ``field`` says exactly where the
constraint came from, and refuses (400) a request that carries two constraints, whatever their
spellings. A top-level field that no body type declares is refused (400, OpenAI's wording) where
the body is decoded (``pipeline.protocol.bodies``, ``pipeline.protocol.wire``).

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

A structural tag is validated here (shape only; each field of a bad one is named, e.g.
``response_format.structures[0].schema``) and normalized to xgrammar 0.2's top-level object
``{"type": "structural_tag", "format": {...}}``, the legacy shape becoming the ``triggered_tags``
format xgrammar itself converts it to. Keys xgrammar would silently ignore are refused, and so are
token-level formats (``token``, ``exclude_token``, ``any_tokens``, ``token_triggered_tags``,
``token_dispatch``, token begin/end): the answer check sees text, not token ids, so it could not
prove them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from pipeline.errors import InvalidRequest
from pipeline.types import GrammarKind, GrammarSpec

__all__ = ["CONSTRAINT_FIELDS", "parse_constraint"]

# Nesting bound for structural-tag formats: a hostile body must get a 400, not a RecursionError.
_MAX_FORMAT_DEPTH = 32


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, stage="admission")


# -- small checkers -----------------------------------------------------------------------------------
def _only_keys(obj: dict[str, Any], allowed: Iterable[str], where: str) -> None:
    """Refuse keys we would otherwise drop; a key set to null asks for nothing and passes."""
    allowed = tuple(allowed)
    for key, value in obj.items():
        if key not in allowed and value is not None:
            raise _fail(f"unknown key {key!r} in {where} (expected {', '.join(allowed)})", f"{where}.{key}")


def _string(value: Any, field: str, *, non_empty: bool = False) -> str:
    if not isinstance(value, str) or (non_empty and not value):
        raise _fail(f"'{field}' must be a {'non-empty ' if non_empty else ''}string", field)
    return value


def _boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(f"'{field}' must be a boolean", field)
    return value


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(f"'{field}' must be a non-negative integer", field)
    return value


def _strings(value: Any, field: str, *, non_empty_list: bool, non_empty_items: bool) -> list[str]:
    ok = isinstance(value, list) and (value or not non_empty_list)
    if ok and not all(isinstance(s, str) and (s or not non_empty_items) for s in value):
        ok = False
    if not ok:
        items = "non-empty strings" if non_empty_items else "strings"
        raise _fail(f"'{field}' must be a {'non-empty ' if non_empty_list else ''}list of {items}", field)
    return list(value)


def _json_text(value: str, field: str) -> Any:
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _fail(f"'{field}' is not valid JSON: {exc}", field) from None


def _schema(value: Any, field: str) -> dict[str, Any] | bool:
    """A JSON schema: an object or a boolean, or a string holding one (vLLM and SGLang send strings)."""
    if isinstance(value, str):
        value = _json_text(value, field)
    if not isinstance(value, dict | bool):
        raise _fail(f"'{field}' must be a JSON schema (an object or a boolean)", field)
    return value


# -- the simple kinds -----------------------------------------------------------------------------------
def _json_schema_spec(value: Any, field: str) -> GrammarSpec:
    return GrammarSpec("json_schema", _schema(value, field), field=field)


def _string_spec(kind: GrammarKind, value: Any, field: str) -> GrammarSpec:
    return GrammarSpec(kind, _string(value, field, non_empty=True), field=field)


def _choice_spec(value: Any, field: str) -> GrammarSpec:
    return GrammarSpec("choice", _strings(value, field, non_empty_list=True, non_empty_items=True), field=field)


def _json_object_spec(value: Any, field: str) -> GrammarSpec:
    # vLLM counts any non-null json_object as the constraint; only ``true`` has a clear meaning.
    if value is not True:
        raise _fail(f"'{field}' must be true (leave it out for no constraint)", field)
    return GrammarSpec("json_object", None, field=field)


def _structural_tag_spec(value: Any, field: str) -> GrammarSpec:
    # vLLM's ``structural_tag`` fields are JSON strings; objects are accepted too.
    if isinstance(value, str):
        value = _json_text(value, field)
    return GrammarSpec("structural_tag", _structural_tag(value, field), field=field)


# -- response_format ------------------------------------------------------------------------------------
def _response_format(raw: Any) -> GrammarSpec | None:
    where = "response_format"
    if not isinstance(raw, dict):
        raise _fail("'response_format' must be an object", where)
    kind = raw.get("type")
    if kind == "text":
        _only_keys(raw, ("type",), where)
        return None
    if kind == "json_object":
        if raw.get("schema") is not None:  # Fireworks' and Together's spelling of a schema
            _only_keys(raw, ("type", "schema"), where)
            return _json_schema_spec(raw["schema"], "response_format.schema")
        _only_keys(raw, ("type",), where)
        return GrammarSpec("json_object", None, field=where)
    if kind == "json_schema":
        _only_keys(raw, ("type", "json_schema", "schema"), where)
        spec, shortcut = raw.get("json_schema"), raw.get("schema")
        if shortcut is not None:  # SGLang's shortcut: the schema right under response_format
            if spec is not None:
                raise _fail(
                    "give the schema once: response_format.json_schema.schema or response_format.schema",
                    "response_format.schema",
                )
            return _json_schema_spec(shortcut, "response_format.schema")
        where = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise _fail("'response_format.json_schema' must be an object", where)
        _only_keys(spec, ("name", "description", "schema", "strict"), where)
        # OpenAI requires ``name``; it labels the schema and constrains nothing, so it may be left out.
        # ``description`` is a hint to the model; the answer must satisfy the schema either way.
        for key in ("name", "description"):
            if spec.get(key) is not None:
                _string(spec[key], f"{where}.{key}")
        if spec.get("schema") is None:
            raise _fail("'response_format.json_schema.schema' is required", f"{where}.schema")
        schema = _schema(spec["schema"], f"{where}.schema")
        strict = spec.get("strict")
        strict = True if strict is None else _boolean(strict, f"{where}.strict")
        return GrammarSpec("json_schema", schema, strict=strict, field=f"{where}.schema")
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", _structural_tag(raw, where), field=where)
    raise _fail(
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
        raise _fail(
            f"'{field}' is not supported: JSON is generated without free whitespace; leave it out",
            field,
        )


# Options that change nothing the answer must satisfy (see the module docstring), with their type.
_STRUCTURED_OUTPUTS_OPTIONS: dict[str, Callable[[Any, str], object]] = {
    "disable_any_whitespace": _boolean,
    "disable_additional_properties": _boolean,
    "whitespace_pattern": _whitespace_pattern,
    "backend": _string,
    "disable_fallback": _boolean,
}


def _structured_outputs(raw: Any) -> GrammarSpec:
    where = "structured_outputs"
    if not isinstance(raw, dict):
        raise _fail("'structured_outputs' must be an object", where)
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
            raise _fail(f"unknown key {key!r} in structured_outputs (expected {', '.join(known)})", field)
    if not found:
        raise _fail(f"'structured_outputs' needs exactly one of {', '.join(_STRUCTURED_OUTPUTS)}", where)
    return found[0]


# -- structural tags ------------------------------------------------------------------------------------
def _structural_tag(raw: Any, where: str) -> dict[str, Any]:
    """Validate a structural tag (either shape) and return xgrammar 0.2's top-level object."""
    if not isinstance(raw, dict):
        raise _fail(f"'{where}' must be an object", where)
    if raw.get("type") not in (None, "structural_tag"):
        raise _fail(f"'{where}.type' must be 'structural_tag'", f"{where}.type")
    if raw.get("format") is not None:
        if raw.get("structures") is not None:
            raise _fail("give 'format' (xgrammar 0.2) or 'structures' and 'triggers' (legacy), not both", where)
        _only_keys(raw, ("type", "format"), where)
        return {"type": "structural_tag", "format": _format(raw["format"], f"{where}.format", 0)}
    if raw.get("structures") is None:
        raise _fail(
            f"'{where}' needs 'format' (xgrammar 0.2) or 'structures' and 'triggers' (legacy)", f"{where}.format"
        )
    # The legacy shape (vLLM, SGLang): tagged JSON schemas, dispatched on triggers. SGLang adds at_least_one.
    _only_keys(raw, ("type", "structures", "triggers", "at_least_one"), where)
    structures = raw["structures"]
    if not isinstance(structures, list) or not structures:
        raise _fail(f"'{where}.structures' must be a non-empty list", f"{where}.structures")
    triggers = _strings(raw.get("triggers"), f"{where}.triggers", non_empty_list=True, non_empty_items=True)
    at_least_one = raw.get("at_least_one")
    tags: list[dict[str, Any]] = []
    for i, item in enumerate(structures):
        at = f"{where}.structures[{i}]"
        if not isinstance(item, dict):
            raise _fail(f"'{at}' must be an object with begin, schema and end", at)
        _only_keys(item, ("begin", "schema", "end"), at)
        begin = _string(item.get("begin"), f"{at}.begin", non_empty=True)
        if item.get("schema") is None:
            raise _fail(f"'{at}.schema' is required", f"{at}.schema")
        content = {"type": "json_schema", "json_schema": _schema(item["schema"], f"{at}.schema")}
        end = _string(item.get("end"), f"{at}.end")
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    _check_triggers(triggers, [(t["begin"], f"{where}.structures[{i}].begin") for i, t in enumerate(tags)])
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "at_least_one": False if at_least_one is None else _boolean(at_least_one, f"{where}.at_least_one"),
            "stop_after_first": False,
        },
    }


def _check_triggers(triggers: list[str], begins: list[tuple[str, str]]) -> None:
    # xgrammar: each tag's begin must start with exactly one trigger.
    for begin, field in begins:
        matched = [t for t in triggers if begin.startswith(t)]
        if len(matched) != 1:
            how = "no trigger" if not matched else f"several triggers ({', '.join(map(repr, matched))})"
            raise _fail(f"tag begin {begin!r} starts with {how}; it must start with exactly one", field)


# Each checker takes (value, field, depth) and returns the normalized value.
_Check = Callable[[Any, str, int], Any]


def _c_string(value: Any, field: str, depth: int) -> str:
    return _string(value, field)


def _c_nonempty_string(value: Any, field: str, depth: int) -> str:
    return _string(value, field, non_empty=True)


def _c_bool(value: Any, field: str, depth: int) -> bool:
    return _boolean(value, field)


def _c_count(value: Any, field: str, depth: int) -> int:
    return _count(value, field)


def _c_strings(value: Any, field: str, depth: int) -> list[str]:
    return _strings(value, field, non_empty_list=False, non_empty_items=False)


def _c_triggers(value: Any, field: str, depth: int) -> list[str]:
    return _strings(value, field, non_empty_list=True, non_empty_items=True)


def _c_schema(value: Any, field: str, depth: int) -> dict[str, Any] | bool:
    if not isinstance(value, dict | bool):  # xgrammar takes an object or a boolean here, not a string
        raise _fail(f"'{field}' must be a JSON schema (an object or a boolean)", field)
    return value


_STYLES = (
    "json",
    "qwen_xml",
    "minimax_xml",
    "minimax_m3_xml",
    "deepseek_xml",
    "glm_xml",
    "cohere_xml",
    "kimi_k3_xml",
    "deepseek_v4_1_xml",
)


def _c_style(value: Any, field: str, depth: int) -> str:
    if value not in _STYLES:
        raise _fail(f"'{field}' must be one of {', '.join(_STYLES)}", field)
    return str(value)


def _c_format(value: Any, field: str, depth: int) -> dict[str, Any]:
    return _format(value, field, depth + 1)


def _c_formats(value: Any, field: str, depth: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _fail(f"'{field}' must be a non-empty list of formats", field)
    return [_format(v, f"{field}[{i}]", depth + 1) for i, v in enumerate(value)]


def _c_end(value: Any, field: str, depth: int) -> str | list[str]:
    if isinstance(value, list):
        return _strings(value, field, non_empty_list=True, non_empty_items=False)
    if not isinstance(value, str):
        raise _fail(f"'{field}' must be a string or a non-empty list of strings (token ends are not supported)", field)
    return value


def _c_begin(value: Any, field: str, depth: int) -> str:
    if not isinstance(value, str):
        raise _fail(f"'{field}' must be a string (token begins are not supported)", field)
    return value


def _c_tags(value: Any, field: str, depth: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _fail(f"'{field}' must be a non-empty list of tags", field)
    tags = []
    for i, tag in enumerate(value):
        at = f"{field}[{i}]"
        # In a list of tags xgrammar lets "type" default to "tag"; anything else is not a tag.
        if isinstance(tag, dict) and tag.get("type", "tag") != "tag":
            raise _fail(f"'{at}.type' must be 'tag'", f"{at}.type")
        if isinstance(tag, dict) and "type" not in tag:
            tag = {"type": "tag", **tag}
        tags.append(_format(tag, at, depth + 1))
    return tags


def _c_repeat_max(value: Any, field: str, depth: int) -> int:
    if value == -1 and not isinstance(value, bool):
        return -1  # unbounded
    return _count(value, field)


def _c_rules(value: Any, field: str, depth: int) -> list[list[Any]]:
    if not isinstance(value, list) or not value:
        raise _fail(f"'{field}' must be a non-empty list of [pattern, format] pairs", field)
    rules = []
    for i, rule in enumerate(value):
        at = f"{field}[{i}]"
        if not isinstance(rule, list) or len(rule) != 2:
            raise _fail(f"'{at}' must be a [pattern, format] pair", at)
        rules.append([_string(rule[0], f"{at}[0]", non_empty=True), _format(rule[1], f"{at}[1]", depth + 1)])
    return rules


# type -> key -> (checker, required); the shapes of xgrammar 0.2.8's text-level formats.
_FORMATS: dict[str, dict[str, tuple[_Check, bool]]] = {
    "const_string": {"value": (_c_string, True)},
    "json_schema": {
        "json_schema": (_c_schema, True),
        "style": (_c_style, False),
        "any_order": (_c_bool, False),
        "max_whitespace_cnt": (_c_count, False),
        "excludes": (_c_strings, False),
    },
    "qwen_xml_parameter": {"json_schema": (_c_schema, True)},  # deprecated by xgrammar, still loaded
    "any_text": {"excludes": (_c_strings, False), "max_tokens": (_c_count, False), "max_chars": (_c_count, False)},
    "grammar": {"grammar": (_c_nonempty_string, True)},
    "regex": {"pattern": (_c_nonempty_string, True)},
    "sequence": {"elements": (_c_formats, True)},
    "or": {"elements": (_c_formats, True)},
    "tag": {"begin": (_c_begin, True), "content": (_c_format, True), "end": (_c_end, True)},
    "triggered_tags": {
        "triggers": (_c_triggers, True),
        "tags": (_c_tags, True),
        "at_least_one": (_c_bool, False),
        "stop_after_first": (_c_bool, False),
        "excludes": (_c_strings, False),
    },
    "tags_with_separator": {
        "tags": (_c_tags, True),
        "separator": (_c_string, True),
        "at_least_one": (_c_bool, False),
        "stop_after_first": (_c_bool, False),
    },
    "optional": {"content": (_c_format, True)},
    "plus": {"content": (_c_format, True)},
    "star": {"content": (_c_format, True)},
    "repeat": {"min": (_c_count, True), "max": (_c_repeat_max, True), "content": (_c_format, True)},
    "dispatch": {"rules": (_c_rules, True), "loop": (_c_bool, False), "excludes": (_c_strings, False)},
}
# Formats over token ids: the answer check sees text, so it could not prove them.
_TOKEN_FORMATS = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch")


def _format(raw: Any, where: str, depth: int) -> dict[str, Any]:
    if depth > _MAX_FORMAT_DEPTH:
        raise _fail(f"structural tag formats nest deeper than {_MAX_FORMAT_DEPTH} levels", where)
    if not isinstance(raw, dict):
        raise _fail(f"'{where}' must be a format object with a 'type'", where)
    kind = raw.get("type")
    if kind in _TOKEN_FORMATS:
        raise _fail(f"token-level format {kind!r} is not supported (answers are checked as text)", f"{where}.type")
    keys = _FORMATS.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise _fail(f"unknown format type {kind!r} (expected one of {', '.join(_FORMATS)})", f"{where}.type")
    _only_keys(raw, ("type", *keys), where)
    out: dict[str, Any] = {"type": kind}
    for key, (check, required) in keys.items():
        if raw.get(key) is None:
            if required:
                raise _fail(f"a {kind} format needs '{key}'", f"{where}.{key}")
            continue
        out[key] = check(raw[key], f"{where}.{key}", depth)
    if kind == "triggered_tags":
        _check_triggers(out["triggers"], [(t["begin"], f"{where}.tags[{i}].begin") for i, t in enumerate(out["tags"])])
    if kind == "repeat" and out["max"] != -1 and out["min"] > out["max"]:
        raise _fail(f"repeat min ({out['min']}) must not exceed max ({out['max']})", f"{where}.max")
    return out


# -- the whole body ------------------------------------------------------------------------------------
def _guided_decoding_backend(value: Any) -> None:
    _string(value, "guided_decoding_backend")  # which engine runs is ours to choose; see the docstring


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
    return _fail(
        f"give at most one structured-output constraint; got {first.field} and {second.field}",
        second.field,
    )


def parse_constraint(body: dict[str, Any]) -> GrammarSpec | None:
    """The request's one structured-output constraint, in whichever spelling it came (module docstring).

    :raises InvalidRequest: a constraint of the wrong shape (naming its field), an unsupported option,
        or two constraints (naming the second, in body order, and listing both).
    """
    if not isinstance(body, dict):
        raise _fail("the request body must be a JSON object", "body")
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
