"""A schema's local ``$ref``s that point at nothing, found where the schema's author wrote them.

A tool's parameters are moved under the calls schema's ``$defs`` before they are compiled
(``pipeline/protocol/tools.py``), their refs re-pointed there: a compiler's complaint about a missing
target then names a path the client never wrote (``#/$defs/f/definitions/missing``). Checked first,
on the parameters as sent, the error names the client's own path and ref.

Only the places a compiler reads as schemas are walked: a ``$ref`` key inside a ``const``, ``enum``
or ``default`` value is data, not a reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stages.grammar.json_pointer import resolve_local_ref

__all__ = ["dangling_local_ref"]

# keywords whose value is one schema, a list of schemas, or a map of names to schemas
_ONE = frozenset(
    {
        "additionalProperties",
        "additionalItems",
        "unevaluatedProperties",
        "unevaluatedItems",
        "items",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    }
)
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})


def _subschemas(node: dict[str, Any], where: str) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if key in _ONE and isinstance(value, dict):
            yield f"{where}/{key}", value
        elif key in _LIST and isinstance(value, list):
            yield from ((f"{where}/{key}/{i}", item) for i, item in enumerate(value))
        elif key in _MAP and isinstance(value, dict):
            yield from ((f"{where}/{key}/{name}", item) for name, item in value.items())


def dangling_local_ref(schema: Any) -> tuple[str, str] | None:
    """The first local ``$ref`` (``#...``) in ``schema`` whose target is not in it, as (the JSON
    Pointer of the schema holding it, the ref); None when every one resolves. Iterative."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and resolve_local_ref(schema, ref) is None:
            return where or "/", ref
        stack.extend(reversed(list(_subschemas(node, where))))
    return None
