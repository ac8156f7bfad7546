"""Hypothesis strategies drawn from the server's own OpenAPI document (its JSON schemas).

Covers the schema keywords msgspec writes for the ``pipeline.protocol`` body types (``$ref``, ``anyOf``, ``enum``,
objects with ``required``/``additionalProperties``, bounded arrays, strings with lengths and
patterns, bounded numbers); a schema with no ``type`` (a raw JSON field) draws any JSON value.
Sizes are kept small: the point is reaching every check, not volume.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

__all__ = ["ANY_JSON", "from_schema"]

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid against ``schema``, whose ``$ref``s point into ``components``."""
    return _Builder(components).build(schema)


class _Builder:
    def __init__(self, components: dict[str, Any]) -> None:
        self.components = components

    def build(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[1]
            return st.deferred(lambda: self.build(self.components[name]))
        if "anyOf" in schema:
            return st.one_of([self.build(option) for option in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if kind is None:
            return ANY_JSON
        builders = {
            "object": self._object,
            "array": self._array,
            "string": _string,
            "integer": _integer,
            "number": _number,
            "boolean": lambda _: st.booleans(),
            "null": lambda _: st.none(),
        }
        return builders[kind](schema)

    def _object(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        properties = schema.get("properties")
        if properties is None:  # a map: dict[str, T]
            values = schema.get("additionalProperties")
            return st.dictionaries(st.text(max_size=6), self.build(values) if values else ANY_JSON, max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: self.build(v) for k, v in properties.items() if k in required},
            optional={k: self.build(v) for k, v in properties.items() if k not in required},
        )

    def _array(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        low = schema.get("minItems", 0)
        items = self.build(schema["items"]) if "items" in schema else ANY_JSON
        return st.lists(items, min_size=low, max_size=min(schema.get("maxItems", low + 3), low + 3))


def _string(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    if "pattern" in schema:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        return st.from_regex(schema["pattern"], fullmatch=True).filter(
            lambda s: low <= len(s) and (high is None or len(s) <= high)
        )
    low = schema.get("minLength", 0)
    return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 24), 24)))


def _integer(schema: dict[str, Any]) -> st.SearchStrategy[int]:
    return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))


def _number(schema: dict[str, Any]) -> st.SearchStrategy[float]:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    return st.floats(
        min_value=low,
        max_value=schema.get("maximum"),
        exclude_min="exclusiveMinimum" in schema,
        allow_nan=False,
        allow_infinity=False,
    )
