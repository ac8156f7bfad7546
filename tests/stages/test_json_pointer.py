"""One reading of local ``$ref`` pointers, shared by the schema walkers."""

from __future__ import annotations

import pytest

from stages.grammar.empty_schemas import empty_schema_reason
from stages.grammar.json_pointer import resolve_local_ref
from stages.grammar.schema_walk import SchemaWalk

ROOT = {
    "$defs": {"a/b": {"type": "integer"}, "a~b": {"type": "string"}, "a b": False, "list": [{"type": "null"}]},
    "type": "object",
}


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("#", ROOT),
        ("#/$defs/a~1b", {"type": "integer"}),
        ("#/$defs/a~0b", {"type": "string"}),
        ("#/$defs/a%20b", False),
        ("#/$defs/list/0", {"type": "null"}),
        ("#/$defs/list/1", None),
        ("#/$defs/missing", None),
        ("#anchor", None),  # a named anchor is not a pointer: it must not read as the root
        ("other.json#/$defs/a~1b", None),
    ],
)
def test_resolve_local_ref(ref: str, expected: object) -> None:
    assert resolve_local_ref(ROOT, ref) == expected


def test_both_walkers_read_a_percent_encoded_pointer() -> None:
    schema = {"$defs": {"a b": False}, "properties": {"x": {"$ref": "#/$defs/a%20b"}}, "required": ["x"]}
    assert empty_schema_reason(schema) == "required property 'x': /properties/x is false"

    def deep(ref: str) -> dict[str, object]:
        target = {"properties": {"y": {"properties": {"z": {}}}}}
        return {"$defs": {"a b": target}, "properties": {"x": {"$ref": ref}}}

    # through the reference the path is one level deeper than through $defs
    assert SchemaWalk(deep("#/$defs/a%20b")).depth(100) == SchemaWalk(deep("#/$defs/missing")).depth(100) + 1


def test_an_anchor_ref_is_not_a_reference_to_the_root() -> None:
    # read as "#", this bare self-reference would be reported as a $ref chain that never ends
    assert empty_schema_reason({"$ref": "#anchor"}) is None
