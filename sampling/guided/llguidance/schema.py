"""xgrammar's ``strict_mode`` for llguidance: a JSON schema closed where xgrammar closes it.

xgrammar's strict mode gives objects with ``properties`` no undeclared property and arrays with
``prefixItems`` no undeclared item; llguidance follows the schema as written, so a strict schema is
closed here first, the same way, before llguidance compiles it (sampling/guided/llguidance/backend.py).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["close_schema"]

# JSON-schema keywords whose value is one subschema, a list of them, or a map of name -> subschema
_SUB_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_COMBINATORS = frozenset({"anyOf", "oneOf", "allOf", "$ref"})  # siblings of these are intersected with them
_OPENERS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "patternProperties"})
_ANNOTATIONS = frozenset({"$ref", "description", "title", "default", "examples", "$comment", "deprecated"})
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _guarded_refs(node: Any, found: set[str]) -> set[str]:
    """Local refs whose target is intersected with something: members of a multi-allOf, refs with siblings."""
    if isinstance(node, dict):
        all_of = node.get("allOf")
        members: list[Any] = all_of if isinstance(all_of, list) and len(all_of) > 1 else []
        for sub in [*members, node if node.keys() - _ANNOTATIONS else None]:
            if isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
                found.add(sub["$ref"].removeprefix("#"))
        for value in node.values():
            _guarded_refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _guarded_refs(value, found)
    return found


def _close(node: Any, guarded: set[str], path: str, is_intersected: bool) -> None:
    """xgrammar's strict mode, in place: objects with ``properties`` and arrays with ``prefixItems``
    take nothing undeclared. Not where the schema is intersected with another (allOf members, $ref
    siblings, branches beside object keywords), nor where ``required`` names an undeclared property:
    closing there would refuse what the other side declares (llguidance: "unsatisfiable")."""
    if not isinstance(node, dict):
        return
    is_open = not is_intersected and path not in guarded and not _COMBINATORS & node.keys()
    declared = node.get("properties")
    required: list[Any] = node["required"] if isinstance(node.get("required"), list) else []
    if is_open and isinstance(declared, dict) and not _OPENERS & node.keys() and set(required) <= declared.keys():
        node["additionalProperties"] = False
    if is_open and isinstance(node.get("prefixItems"), list) and "items" not in node:
        node["items"] = False
    for key in _SUB_ONE:
        _close(node.get(key), guarded, f"{path}/{key}", False)
    has_object_keywords = bool(_OBJECT_KEYWORDS & node.keys())
    for key in _SUB_LIST:
        if isinstance(node.get(key), list):
            intersected = key in _COMBINATORS and (
                is_intersected or has_object_keywords or (key == "allOf" and len(node[key]) > 1)
            )
            for i, sub in enumerate(node[key]):
                _close(sub, guarded, f"{path}/{key}/{i}", intersected)
    for key in _SUB_MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _close(sub, guarded, f"{path}/{key}/{name}", False)


def close_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` closed as xgrammar's ``strict_mode`` closes it (see ``_close``)."""
    closed = copy.deepcopy(schema)
    _close(closed, _guarded_refs(closed, set()), "", False)
    return closed
