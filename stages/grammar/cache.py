"""The grammar stage's cache: compiled constraints and refusals by canonical spec, bounded by bytes.

Least recently used first out; one entry may hold at most a quarter of the bound (a bigger one is
compiled again next time rather than evicting everything else). Refusals are cached too, at a
nominal size, so the same bad spec fails the same way for free.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from stages.lru import Lru

__all__ = ["GrammarCache", "Sized"]

ERROR_BYTES = 1024  # a cached refusal's nominal size


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


E = TypeVar("E", bound=Sized)


class GrammarCache(Generic[E]):
    """Entries (``E``, which reports ``nbytes``) or refusals (exceptions) by key, within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.evictions = 0
        self._entries: Lru[str, E | Exception] = Lru(max_bytes, _size)

    @property
    def max_bytes(self) -> int:
        return self._entries.max_weight

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:  # the bound is the map's own: one number, never two
        self._entries.max_weight = value

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._entries.weight

    def get(self, key: str) -> E | Exception | None:
        """The entry of ``key`` without touching its recency."""
        return self._entries.peek(key)

    def hit(self, key: str) -> E | Exception | None:
        """The entry of ``key``, now the most recently used."""
        return self._entries.get(key)

    def store(self, key: str, entry: E | Exception) -> None:
        if _size(entry) > self.max_bytes // 4:
            return  # too big to keep: the next request compiles it again
        self.evictions += self._entries.put(key, entry)


def _size(entry: Sized | Exception) -> int:
    return ERROR_BYTES if isinstance(entry, Exception) else entry.nbytes
