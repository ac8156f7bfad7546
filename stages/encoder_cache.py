"""Encoder cache: vision embeddings by image content, bounded in bytes, least recently used out.

Keyed by (content hash, model, processor settings): the model and processor part is a namespace
fixed when the cache is built, so one cache never serves embeddings of another model or of other
pixels. A hit skips decode, the image processor and the encoder.

Single flight: the first request to miss an image owns its ``Flight`` and encodes it; requests that
ask meanwhile wait for that one encode. A waiter that is cancelled leaves alone; an owner that fails
or is cancelled abandons its flight, and one of the waiters takes it over (no waiter inherits the
owner's error or cancellation). Callers claim several images in sorted hash order, one at a time, so
two requests that share two images never wait on each other in a cycle.

It lives in the serving process, where requests are prepared. With the vision encoder in the engine
process (``vision_encoder_placement``) the same cache keeps each image's pixels instead (a
``PreparedImage``): a hit skips decode and the image processor, and the embeddings are kept beside
the engine (pipeline/engine/images.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import anyio
import torch

from stages.lru import Lru

__all__ = ["CacheStats", "EncodedImage", "EncoderCache", "Flight"]


class _Weighed(Protocol):
    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=_Weighed)


@dataclass(frozen=True, slots=True, eq=False)
class EncodedImage:
    """An image as the rest of the pipeline needs it once encoded: its grid and its embeddings."""

    content_hash: str
    embeds: torch.Tensor  # [num_patches, hidden] on the CPU
    grid_thw: tuple[int, int, int]  # its token grid: frames, down, across (vision/preprocess.py)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def nbytes(self) -> int:
        return self.embeds.numel() * self.embeds.element_size()


@dataclass(slots=True)
class CacheStats:
    """Counters of one cache (encoder or KV prefix), read by /metrics and the benchmarks."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_held: int = 0
    bytes_bound: int = 0
    entries: int = 0


@dataclass(eq=False)
class Flight(Generic[V]):
    """One encode in progress; its owner ends it with ``EncoderCache.fulfil`` or ``abandon``."""

    content_hash: str
    done: anyio.Event = field(default_factory=anyio.Event)
    value: V | None = None


class EncoderCache(Generic[V]):
    """Event-loop only (no lock): every call is bookkeeping, the encode itself happens elsewhere.

    ``V``: what an image is kept as, ``EncodedImage`` (or its pixels, a ``PreparedImage``)."""

    def __init__(self, max_bytes: int, namespace: str) -> None:
        self.max_bytes = max_bytes
        self.namespace = namespace  # model and processor settings
        self.stats = CacheStats(bytes_bound=max_bytes)
        self._entries: Lru[str, V] = Lru(max_bytes, lambda image: image.nbytes)
        self._flights: dict[str, Flight[V]] = {}

    def _key(self, content_hash: str) -> str:
        return f"{self.namespace}:{content_hash}"

    @property
    def num_flights(self) -> int:
        return len(self._flights)

    def holds(self, content_hash: str) -> bool:
        """Whether the embeddings of ``content_hash`` are cached now (a hint: nothing is claimed)."""
        return self._key(content_hash) in self._entries

    async def claim(self, content_hash: str) -> V | Flight[V]:
        """The cached image (a hit, possibly after waiting for another request's encode), or a
        ``Flight`` the caller now owns and must fulfil or abandon (a miss)."""
        key = self._key(content_hash)
        while True:
            entry = self._entries.get(key)
            if entry is not None:
                self.stats.hits += 1
                return entry
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = Flight[V](content_hash)
                self.stats.misses += 1
                return flight
            await flight.done.wait()
            if flight.value is not None:  # encoded, even if too large to keep
                self.stats.hits += 1
                return flight.value
            # abandoned: look again, and perhaps own it now

    def fulfil(self, flight: Flight[V], value: V) -> None:
        """Keep ``value`` (when it fits the bound) and wake the flight's waiters."""
        key = self._key(flight.content_hash)
        if self._flights.get(key) is flight:
            del self._flights[key]
        flight.value = value
        flight.done.set()
        if value.nbytes <= self.max_bytes and key not in self._entries:
            self.stats.evictions += self._entries.put(key, value)
            self.stats.bytes_held = self._entries.weight
            self.stats.entries = len(self._entries)

    def abandon(self, flight: Flight[V]) -> None:
        """The owner gives up (failed or cancelled): a waiter takes over. A no-op once fulfilled."""
        key = self._key(flight.content_hash)
        if self._flights.get(key) is flight:
            del self._flights[key]
        flight.done.set()
