"""The check that refuses a strict schema nothing here can hold: a remote ``$ref``.

Keywords xgrammar ignores (``uniqueItems``, ``not``, ``if``/``then``, ...) no longer refuse a schema:
the answer check (``stages/grammar/answer_check.py``) validates every answer against the whole schema, and a
failing answer is resampled or refused, never returned. What neither a grammar nor the check can hold
is a remote ``$ref`` (never fetched): a ``strict`` schema with one is refused with a 400 naming it;
``strict: false`` accepts it as any value.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import UnsupportedSchemaError

__all__ = ["check_schema_support", "find_unholdable"]


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
