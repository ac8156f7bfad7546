"""Lru: a map bounded by the summed weight of its values, least recently used out.

The caches of the stages are this one structure with different weights: the data-URL keys count
entries (weight 1), the encoder cache and the grammar cache count bytes. What a cache counts (hits,
misses, bytes held) stays its own; ``put`` says how many entries it evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Lru"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _one(value: object) -> int:
    return 1


class Lru(Generic[K, V]):
    """Values by key within ``max_weight`` (the sum of ``weight(value)``); not thread-safe."""

    def __init__(
        self, max_weight: int, weight: Callable[[V], int] = _one, on_evict: Callable[[K], None] | None = None
    ) -> None:
        self.max_weight = max_weight
        self.weight = 0  # of the values held
        self._weigh = weight
        self._on_evict = on_evict  # told each key ``put`` evicts (a mirror of the cache drops it too)
        self._entries: OrderedDict[K, V] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def peek(self, key: K) -> V | None:
        """The value of ``key``, its recency untouched."""
        return self._entries.get(key)

    def get(self, key: K) -> V | None:
        """The value of ``key``, now the most recently used."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value (None: it was not held). No eviction callback: it was not evicted."""
        value = self._entries.pop(key, None)
        if value is not None:
            self.weight -= self._weigh(value)
        return value

    def put(self, key: K, value: V) -> int:
        """Hold ``value`` as the most recently used (replacing ``key``'s value), then evict the least
        recently used while over the bound; returns how many were evicted. A caller keeps out a value
        heavier than the bound (it would evict everything, itself last)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.weight -= self._weigh(old)
        self._entries[key] = value
        self.weight += self._weigh(value)
        evicted = 0
        while self.weight > self.max_weight:
            key_gone, gone = self._entries.popitem(last=False)
            self.weight -= self._weigh(gone)
            evicted += 1
            if self._on_evict is not None:
                self._on_evict(key_gone)
        return evicted
