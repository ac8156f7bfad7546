"""Structural tags, in xgrammar 0.2's shape or the legacy one of vLLM and SGLang, checked and normalized.

A structural tag is validated here (shape only; each field of a bad one is named, e.g.
``response_format.structures[0].schema``) and normalized to xgrammar 0.2's top-level object
``{"type": "structural_tag", "format": {...}}``, the legacy shape becoming the ``triggered_tags``
format xgrammar itself converts it to. Keys xgrammar would silently ignore are refused, and so are
token-level formats (``token``, ``exclude_token``, ``any_tokens``, ``token_triggered_tags``,
``token_dispatch``, token begin/end): the answer check sees text, not token ids, so it could not
prove them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.protocol.json_fields import (
    as_boolean,
    as_count,
    as_schema,
    as_string,
    as_strings,
    field_error,
    only_keys,
)

__all__ = ["structural_tag"]

# Nesting bound for structural-tag formats: a hostile body must get a 400, not a RecursionError.
_MAX_FORMAT_DEPTH = 32


def structural_tag(raw: Any, where: str) -> dict[str, Any]:
    """Validate a structural tag (either shape) and return xgrammar 0.2's top-level object."""
    if not isinstance(raw, dict):
        raise field_error(f"'{where}' must be an object", where)
    if raw.get("type") not in (None, "structural_tag"):
        raise field_error(f"'{where}.type' must be 'structural_tag'", f"{where}.type")
    if raw.get("format") is not None:
        if raw.get("structures") is not None:
            raise field_error("give 'format' (xgrammar 0.2) or 'structures' and 'triggers' (legacy), not both", where)
        only_keys(raw, ("type", "format"), where)
        return {"type": "structural_tag", "format": _format(raw["format"], f"{where}.format", 0)}
    if raw.get("structures") is None:
        raise field_error(
            f"'{where}' needs 'format' (xgrammar 0.2) or 'structures' and 'triggers' (legacy)", f"{where}.format"
        )
    # The legacy shape (vLLM, SGLang): tagged JSON schemas, dispatched on triggers. SGLang adds at_least_one.
    only_keys(raw, ("type", "structures", "triggers", "at_least_one"), where)
    structures = raw["structures"]
    if not isinstance(structures, list) or not structures:
        raise field_error(f"'{where}.structures' must be a non-empty list", f"{where}.structures")
    triggers = as_strings(raw.get("triggers"), f"{where}.triggers", non_empty_list=True, non_empty_items=True)
    at_least_one = raw.get("at_least_one")
    tags: list[dict[str, Any]] = []
    for i, item in enumerate(structures):
        at = f"{where}.structures[{i}]"
        if not isinstance(item, dict):
            raise field_error(f"'{at}' must be an object with begin, schema and end", at)
        only_keys(item, ("begin", "schema", "end"), at)
        begin = as_string(item.get("begin"), f"{at}.begin", non_empty=True)
        if item.get("schema") is None:
            raise field_error(f"'{at}.schema' is required", f"{at}.schema")
        content = {"type": "json_schema", "json_schema": as_schema(item["schema"], f"{at}.schema")}
        end = as_string(item.get("end"), f"{at}.end")
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    _check_triggers(triggers, [(t["begin"], f"{where}.structures[{i}].begin") for i, t in enumerate(tags)])
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "at_least_one": False if at_least_one is None else as_boolean(at_least_one, f"{where}.at_least_one"),
            "stop_after_first": False,
        },
    }


def _check_triggers(triggers: list[str], begins: list[tuple[str, str]]) -> None:
    # xgrammar: each tag's begin must start with exactly one trigger.
    for begin, field in begins:
        matched = [t for t in triggers if begin.startswith(t)]
        if len(matched) != 1:
            how = "no trigger" if not matched else f"several triggers ({', '.join(map(repr, matched))})"
            raise field_error(f"tag begin {begin!r} starts with {how}; it must start with exactly one", field)


# Each checker takes (value, field, depth) and returns the normalized value.
_Check = Callable[[Any, str, int], Any]


def _c_string(value: Any, field: str, depth: int) -> str:
    return as_string(value, field)


def _c_nonempty_string(value: Any, field: str, depth: int) -> str:
    return as_string(value, field, non_empty=True)


def _c_bool(value: Any, field: str, depth: int) -> bool:
    return as_boolean(value, field)


def _c_count(value: Any, field: str, depth: int) -> int:
    return as_count(value, field)


def _c_strings(value: Any, field: str, depth: int) -> list[str]:
    return as_strings(value, field, non_empty_list=False, non_empty_items=False)


def _c_triggers(value: Any, field: str, depth: int) -> list[str]:
    return as_strings(value, field, non_empty_list=True, non_empty_items=True)


def _c_schema(value: Any, field: str, depth: int) -> dict[str, Any] | bool:
    if not isinstance(value, dict | bool):  # xgrammar takes an object or a boolean here, not a string
        raise field_error(f"'{field}' must be a JSON schema (an object or a boolean)", field)
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
        raise field_error(f"'{field}' must be one of {', '.join(_STYLES)}", field)
    return str(value)


def _c_format(value: Any, field: str, depth: int) -> dict[str, Any]:
    return _format(value, field, depth + 1)


def _c_formats(value: Any, field: str, depth: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise field_error(f"'{field}' must be a non-empty list of formats", field)
    return [_format(v, f"{field}[{i}]", depth + 1) for i, v in enumerate(value)]


def _c_end(value: Any, field: str, depth: int) -> str | list[str]:
    if isinstance(value, list):
        return as_strings(value, field, non_empty_list=True, non_empty_items=False)
    if not isinstance(value, str):
        raise field_error(
            f"'{field}' must be a string or a non-empty list of strings (token ends are not supported)", field
        )
    return value


def _c_begin(value: Any, field: str, depth: int) -> str:
    if not isinstance(value, str):
        raise field_error(f"'{field}' must be a string (token begins are not supported)", field)
    return value


def _c_tags(value: Any, field: str, depth: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise field_error(f"'{field}' must be a non-empty list of tags", field)
    tags = []
    for i, tag in enumerate(value):
        at = f"{field}[{i}]"
        # In a list of tags xgrammar lets "type" default to "tag"; anything else is not a tag.
        if isinstance(tag, dict) and tag.get("type", "tag") != "tag":
            raise field_error(f"'{at}.type' must be 'tag'", f"{at}.type")
        if isinstance(tag, dict) and "type" not in tag:
            tag = {"type": "tag", **tag}
        tags.append(_format(tag, at, depth + 1))
    return tags


def _c_repeat_max(value: Any, field: str, depth: int) -> int:
    if value == -1 and not isinstance(value, bool):
        return -1  # unbounded
    return as_count(value, field)


def _c_rules(value: Any, field: str, depth: int) -> list[list[Any]]:
    if not isinstance(value, list) or not value:
        raise field_error(f"'{field}' must be a non-empty list of [pattern, format] pairs", field)
    rules = []
    for i, rule in enumerate(value):
        at = f"{field}[{i}]"
        if not isinstance(rule, list) or len(rule) != 2:
            raise field_error(f"'{at}' must be a [pattern, format] pair", at)
        rules.append([as_string(rule[0], f"{at}[0]", non_empty=True), _format(rule[1], f"{at}[1]", depth + 1)])
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
        raise field_error(f"structural tag formats nest deeper than {_MAX_FORMAT_DEPTH} levels", where)
    if not isinstance(raw, dict):
        raise field_error(f"'{where}' must be a format object with a 'type'", where)
    kind = raw.get("type")
    if kind in _TOKEN_FORMATS:
        raise field_error(
            f"token-level format {kind!r} is not supported (answers are checked as text)", f"{where}.type"
        )
    keys = _FORMATS.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise field_error(f"unknown format type {kind!r} (expected one of {', '.join(_FORMATS)})", f"{where}.type")
    only_keys(raw, ("type", *keys), where)
    out: dict[str, Any] = {"type": kind}
    for key, (check, required) in keys.items():
        if raw.get(key) is None:
            if required:
                raise field_error(f"a {kind} format needs '{key}'", f"{where}.{key}")
            continue
        out[key] = check(raw[key], f"{where}.{key}", depth)
    if kind == "triggered_tags":
        _check_triggers(out["triggers"], [(t["begin"], f"{where}.tags[{i}].begin") for i, t in enumerate(out["tags"])])
    if kind == "repeat" and out["max"] != -1 and out["min"] > out["max"]:
        raise field_error(f"repeat min ({out['min']}) must not exceed max ({out['max']})", f"{where}.max")
    return out
