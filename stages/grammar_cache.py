"""The grammar stage's cache: compiled constraints and refusals by canonical spec, bounded by bytes.

Least recently used first out; one entry may hold at most a quarter of the bound (a bigger one is
compiled again next time rather than evicting everything else). Refusals are cached too, at a
nominal size, so the same bad spec fails the same way for free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

__all__ = ["GrammarCache", "Sized"]

ERROR_BYTES = 1024  # a cached refusal's nominal size


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


E = TypeVar("E", bound=Sized)


class GrammarCache(Generic[E]):
    """Entries (``E``, which reports ``nbytes``) or refusals (exceptions) by key, within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[str, E | Exception] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> E | Exception | None:
        """The entry of ``key`` without touching its recency."""
        return self._entries.get(key)

    def hit(self, key: str) -> E | Exception | None:
        """The entry of ``key``, now the most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def store(self, key: str, entry: E | Exception) -> None:
        size = _size(entry)
        if size > self.max_bytes // 4:
            return  # too big to keep: the next request compiles it again
        self._remove(key)
        self._entries[key] = entry
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.evictions += 1

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= _size(entry)


def _size(entry: Sized | Exception) -> int:
    return ERROR_BYTES if isinstance(entry, Exception) else entry.nbytes
