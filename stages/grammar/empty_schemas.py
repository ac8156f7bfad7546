"""Schemas that provably admit no value, found cheaply, so that they are a 400 naming the field
instead of text: a grammar engine that ignores ``not`` (xgrammar) writes something for
``{"not": {}}``, and a ``$ref`` that only points at itself (``{"$ref": "#"}``) is an infinite regress
that left the mask empty mid-answer (a 500 when it sat under a tool's arguments).

Only what is certain is reported: ``false``, ``not`` of a schema that admits everything, an empty
``enum`` or ``type`` list, a ``$ref`` chain that returns to where it started, and these where a
value must hold them (a required property, an ``allOf`` member, every ``anyOf``/``oneOf`` branch).
Anything else is left to the compilers and the answer check.
"""

from __future__ import annotations

from typing import Any

from stages.grammar.json_pointer import resolve_local_ref

__all__ = ["empty_schema_reason"]

# keywords that never constrain a value: a schema of only these admits everything
_ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples", "deprecated"}
)
_DEFINITIONS = frozenset({"$defs", "definitions"})
# bounds on the walk, not on the schema: deeper levels and further nodes are not looked into
_MAX_DEPTH = 32
_MAX_NODES = 2_000


def empty_schema_reason(schema: Any) -> str | None:
    """Why ``schema`` admits no value (one line, naming the place), or None when it may admit one."""
    return _Walk(schema).reason(schema, "", 0, ())


def _admits_everything(node: Any) -> bool:
    return node is True or (isinstance(node, dict) and not node.keys() - _ANNOTATIONS - _DEFINITIONS)


class _Walk:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.num_left = _MAX_NODES

    def reason(self, node: Any, where: str, depth: int, refs: tuple[str, ...]) -> str | None:
        self.num_left -= 1
        if self.num_left < 0 or depth > _MAX_DEPTH:
            return None
        return _reason(self, node, where, depth, refs)


def _reason(walk: _Walk, node: Any, where: str, depth: int, refs: tuple[str, ...]) -> str | None:
    at = where or "the schema"
    if node is False:
        return f"{at} is false"
    if not isinstance(node, dict):
        return None
    if "not" in node and _admits_everything(node["not"]):
        return f"{at} is 'not' of a schema that admits every value"
    if node.get("enum") == [] or node.get("type") == []:
        return f"{at} has an empty {'enum' if node.get('enum') == [] else 'type'} list"
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref in refs:
            return f"{at}: its $ref chain {' -> '.join((*refs, ref))} never reaches a schema"
        target = resolve_local_ref(walk.root, ref)
        # only a bare $ref is a pure regress: siblings may make the value finite (draft 2019+)
        bare = not node.keys() - _ANNOTATIONS - _DEFINITIONS - {"$ref"}
        found = walk.reason(target, where, depth + 1, (*refs, ref) if bare else ())
        if found is not None:
            return found
    properties = node.get("properties")
    required = node.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        for name in required:
            if isinstance(name, str) and name in properties:
                found = walk.reason(properties[name], f"{where}/properties/{name}", depth + 1, ())
                if found is not None:
                    return f"required property {name!r}: {found}"
    for key, is_all in (("allOf", True), ("anyOf", False), ("oneOf", False)):
        members = node.get(key)
        if not isinstance(members, list) or not members:
            continue
        reasons = [walk.reason(m, f"{where}/{key}/{i}", depth + 1, ()) for i, m in enumerate(members)]
        if is_all and any(reasons):
            return next(r for r in reasons if r)
        if not is_all and all(reasons):
            return f"every branch of {where or 'the schema'}'s {key} admits nothing ({reasons[0]}, ...)"
    return None
