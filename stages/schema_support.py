"""Which JSON-schema keywords xgrammar 0.2.8 ignores, and the check that refuses what nothing can hold.

The lists were found by compiling a one-keyword schema and feeding the grammar an instance that
violates only that keyword (``tests/stages/test_schema_support.py`` repeats the experiment, so an
xgrammar upgrade that changes the answer fails loudly). An ignored keyword no longer refuses a
schema: the answer check (``stages/answer_check.py``) validates every answer against the whole
schema, and a failing answer is resampled or refused, never returned. What neither a grammar nor
the check can hold is a remote ``$ref`` (never fetched): a ``strict`` schema with one is refused
with a 400 naming it; ``strict: false`` accepts it as any value.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import UnsupportedSchemaError

__all__ = ["IGNORED_FORMATS", "IGNORED_KEYWORDS", "check_schema_support", "find_unholdable", "find_unsupported"]

# The grammar accepts instances that violate these.
IGNORED_KEYWORDS = frozenset(
    {
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
    }
)
# Standard formats (JSON Schema 2020-12) that xgrammar does not enforce. Other standard formats it
# enforces; vendor formats ("flag-topic", "byte") are annotations that validators ignore as well.
IGNORED_FORMATS = frozenset({"regex", "iri", "iri-reference", "idn-email", "idn-hostname"})
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OVERLAPPING_TYPES = {"integer": {"number"}, "number": {"integer"}}


def _branches_disjoint(branches: list[Any]) -> bool:
    """True when every oneOf branch names distinct JSON types (then oneOf equals anyOf)."""
    seen: set[str] = set()
    for branch in branches:
        kind = branch.get("type") if isinstance(branch, dict) else None
        if not isinstance(kind, str) or kind in seen or _OVERLAPPING_TYPES.get(kind, set()) & seen:
            return False
        seen.add(kind)
    return True


def find_unsupported(schema: Any, path: str = "") -> list[str]:
    """JSON pointers (``/properties/tags/uniqueItems``) of the keywords xgrammar would ignore."""
    if not isinstance(schema, dict):
        return []
    found = [f"{path}/{key}" for key in schema if key in IGNORED_KEYWORDS]
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in IGNORED_FORMATS:
        found.append(f"{path}/format ({fmt})")
    required, declared = schema.get("required"), schema.get("properties") or {}
    closed = schema.get("additionalProperties", False) is False and "patternProperties" not in schema
    if isinstance(required, list) and isinstance(declared, dict) and closed:
        # strict mode closes objects, so an undeclared required property can never be written and
        # xgrammar drops the requirement instead of failing
        found += [f"{path}/required ({name} is not in properties)" for name in required if name not in declared]
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"{path}/$ref (remote: {ref[:60]})")  # never fetched: xgrammar treats it as any value
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        found.append(f"{path}/allOf (more than one subschema)")
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _branches_disjoint(one_of):
        found.append(f"{path}/oneOf (branches that may overlap)")
    for key in _SUBSCHEMA:
        found += find_unsupported(schema.get(key), f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                found += find_unsupported(sub, f"{path}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                found += find_unsupported(sub, f"{path}/{key}/{name}")
    return found


def find_unholdable(schema: Any, path: str = "") -> list[str]:
    """JSON pointers of what neither backend nor the answer check can enforce: remote ``$ref``s."""
    if isinstance(schema, list):
        return [p for i, sub in enumerate(schema) for p in find_unholdable(sub, f"{path}/{i}")]
    if not isinstance(schema, dict):
        return []
    ref = schema.get("$ref")
    found = [f"{path}/$ref (remote: {ref[:60]})"] if isinstance(ref, str) and not ref.startswith("#") else []
    for key, value in schema.items():
        if key not in ("const", "enum", "default", "examples"):  # values, not schemas
            found += find_unholdable(value, f"{path}/{key}")
    return found


def check_schema_support(schema: Any, *, strict: bool, field: str) -> None:
    """Refuse a strict schema that nothing here can hold to every keyword.

    :raises UnsupportedSchemaError: (400) listing each such keyword with its JSON pointer.
    """
    if not strict:
        return
    found = find_unholdable(schema)
    if found:
        shown = ", ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
        raise UnsupportedSchemaError(
            f"the schema uses keywords that guided decoding cannot enforce: {shown} "
            "(send strict: false to accept an output that may not satisfy them)",
            keywords=found,
            field=field,
            stage="grammar",
        )
