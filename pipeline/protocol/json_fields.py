"""Reads of the raw JSON values a constraint is spelled in, each failure a 400 that names the field.

Shared by the constraint spellings (``pipeline.protocol.constraints``) and the structural-tag
formats (``pipeline.protocol.structural_tags``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pipeline.errors import InvalidRequest

__all__ = [
    "as_boolean",
    "as_count",
    "as_schema",
    "as_string",
    "as_strings",
    "field_error",
    "json_text",
    "only_keys",
]


def field_error(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, stage="admission")


def only_keys(obj: dict[str, Any], allowed: Iterable[str], where: str) -> None:
    """Refuse keys we would otherwise drop; a key set to null asks for nothing and passes."""
    allowed = tuple(allowed)
    for key, value in obj.items():
        if key not in allowed and value is not None:
            raise field_error(f"unknown key {key!r} in {where} (expected {', '.join(allowed)})", f"{where}.{key}")


def as_string(value: Any, field: str, *, non_empty: bool = False) -> str:
    if not isinstance(value, str) or (non_empty and not value):
        raise field_error(f"'{field}' must be a {'non-empty ' if non_empty else ''}string", field)
    return value


def as_boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise field_error(f"'{field}' must be a boolean", field)
    return value


def as_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise field_error(f"'{field}' must be a non-negative integer", field)
    return value


def as_strings(value: Any, field: str, *, non_empty_list: bool, non_empty_items: bool) -> list[str]:
    ok = isinstance(value, list) and (value or not non_empty_list)
    if ok and not all(isinstance(s, str) and (s or not non_empty_items) for s in value):
        ok = False
    if not ok:
        items = "non-empty strings" if non_empty_items else "strings"
        raise field_error(f"'{field}' must be a {'non-empty ' if non_empty_list else ''}list of {items}", field)
    return list(value)


def json_text(value: str, field: str) -> Any:
    try:
        return json.loads(value)
    except RecursionError:
        raise field_error(f"'{field}' nests too deeply to be read as JSON", field) from None
    except json.JSONDecodeError as exc:
        raise field_error(f"'{field}' is not valid JSON: {exc}", field) from None


def as_schema(value: Any, field: str) -> dict[str, Any] | bool:
    """A JSON schema: an object or a boolean, or a string holding one (vLLM and SGLang send strings)."""
    if isinstance(value, str):
        value = json_text(value, field)
    if not isinstance(value, dict | bool):
        raise field_error(f"'{field}' must be a JSON schema (an object or a boolean)", field)
    return value
