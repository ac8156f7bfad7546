"""The target of a local ``$ref`` inside a schema: one reading of JSON Pointer fragments for every
walker of schemas, so that they agree on what a reference points at."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

__all__ = ["resolve_local_ref"]


def resolve_local_ref(root: Any, ref: str) -> Any:
    """The node ``ref`` points at inside ``root`` (``#``, ``#/$defs/a~1b``, ``#/$defs/a%20b``), or None
    when it points nowhere in it or is not a local JSON Pointer (``other.json#/x``, an anchor ``#a``).

    The fragment is a URI fragment, so it is percent-decoded first, then ``~1`` and ``~0`` unescaped
    (RFC 6901, section 6)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
