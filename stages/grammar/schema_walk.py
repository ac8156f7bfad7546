"""A schema's objects and arrays, and its depth through local ``$ref`` chains, walked without recursion
(a hostile schema cannot raise ``RecursionError``): what ``stages.grammar.limits`` bounds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stages.grammar.json_pointer import resolve_local_ref

__all__ = ["SchemaWalk"]


class SchemaWalk:
    """The objects and arrays of a schema, and its depth through local ``$ref``s (iterative)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.num_nodes = 0
        self._targets: dict[str, Any] = {}

    def nodes(self, limit: int) -> Iterator[Any]:
        """Each object and array once, depth first; stops after ``limit + 1``."""
        stack, seen = [self.root], set()
        while stack:
            item = stack.pop()
            if not isinstance(item, dict | list) or id(item) in seen:
                continue
            seen.add(id(item))
            self.num_nodes += 1
            if self.num_nodes > limit:
                return
            yield item
            stack.extend(item.values() if isinstance(item, dict) else item)

    def depth(self, limit: int) -> int:
        """Levels of the deepest path, a ``$ref`` leading one level down into its target; a
        ``$ref`` back to a schema already on the path adds nothing (compilers make it a rule).
        Returns as soon as a path is deeper than ``limit``."""
        done: dict[int, int] = {}
        on_path: set[int] = set()
        stack: list[tuple[Any, bool]] = [(self.root, False)]
        while stack:
            node, is_expanded = stack.pop()
            key = id(node)
            if not is_expanded:
                if key in done or key in on_path:
                    continue
                on_path.add(key)
                stack.append((node, True))
                stack.extend((child, False) for child in self._children(node) if id(child) not in done)
                continue
            on_path.discard(key)
            level = 1 + max((done.get(id(child), 0) for child in self._children(node)), default=0)
            done[key] = level
            if level > limit:
                return level
        return done.get(id(self.root), 0)

    def _children(self, node: Any) -> Iterator[Any]:
        if not isinstance(node, dict | list):  # a boolean schema
            return
        values = node.values() if isinstance(node, dict) else node
        yield from (value for value in values if isinstance(value, dict | list))
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref.startswith("#"):
            target = self._resolve(ref)
            if isinstance(target, dict | list):
                yield target

    def _resolve(self, ref: str) -> Any:
        if ref not in self._targets:
            self._targets[ref] = resolve_local_ref(self.root, ref)
        return self._targets[ref]
