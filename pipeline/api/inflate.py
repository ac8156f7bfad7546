"""Compressed request bodies, inflated off the event loop, bounded in size and, across requests, in
the bytes they hold at once.

A gzip body of 60 KB is 60 MB of JSON once inflated: 24 of them at once took the serving process
from 1.1 GB to 5.4 GB, and a 2 MB body inflating to 2 GB held ``/health`` for seconds, inflated in
64 MB pieces on the event loop. The listener reads bodies as sent (aiohttp's own inflating is off
there), and each compressed one is inflated here:

- in a worker thread (zlib releases the GIL), ``max_inflating`` at once;
- a MiB at a time, and refused (413) as soon as it is over the body limit: a bomb costs the limit;
- under a budget of inflated bytes held at once across all requests: each MiB is taken from the
  budget as it is made, and the whole is given back once the request's answer has been written. A
  body that finds the budget spent is refused with 503 and ``Retry-After``, as a full pipeline
  refuses a request, rather than waiting with its bytes held.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import anyio

from pipeline.errors import InvalidRequest, Overloaded, PayloadTooLarge

__all__ = ["ENCODINGS", "MAX_INFLATING_BYTES", "InflateBudget", "InflateStats", "Lease", "inflate"]

ENCODINGS = ("gzip", "deflate")  # the Content-Encodings inflated here ("identity" needs nothing)
MAX_INFLATING_BYTES = 256 * 1024 * 1024  # the default budget: four bodies at the 64 MiB limit
_IN_BYTES = 64 * 1024  # compressed bytes fed to zlib at once
_OUT_BYTES = 1024 * 1024  # inflated bytes asked of zlib at once: the step of the size check and budget
_MAX_MEMBERS = 1024  # gzip members of one body: each costs a decompressor, however small


@dataclass(slots=True)
class InflateStats:
    """What the budget did since the server started."""

    inflated: int = 0  # bodies inflated whole
    refused: int = 0  # 503: the budget was spent
    too_large: int = 0  # 413: over the body limit once inflated
    most_held: int = 0  # the most inflated bytes held at once


class InflateBudget:
    """At most ``max_bytes`` of inflated request bodies held at once, ``max_inflating`` bodies
    inflated at once. Its counts are thread-safe: worker threads take from it as they inflate."""

    def __init__(self, max_bytes: int, max_inflating: int = 2) -> None:
        if max_bytes < _OUT_BYTES:
            raise ValueError(f"max_bytes must be at least {_OUT_BYTES}, got {max_bytes}")
        if max_inflating < 1:
            raise ValueError(f"max_inflating must be at least 1, got {max_inflating}")
        self.max_bytes = max_bytes
        self.limiter = anyio.CapacityLimiter(max_inflating)
        self.stats = InflateStats()
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Inflated bytes held now."""
        return self._held

    def lease(self) -> Lease:
        """A body's share of the budget, empty until it inflates."""
        return Lease(self)

    def _take(self, lease: Lease, num_bytes: int) -> None:
        with self._lock:
            if self._held + num_bytes > self.max_bytes:
                self.stats.refused += 1
                error = Overloaded(
                    f"the server is inflating {self._held} bytes of compressed request bodies, its limit is "
                    f"{self.max_bytes}; retry later",
                    field="Content-Encoding",
                    stage="admission",
                )
                error.status = 503  # an instance attribute: the server, not the client, is short
                raise error
            self._held += num_bytes
            lease.held += num_bytes
            self.stats.most_held = max(self.stats.most_held, self._held)

    def _give_back(self, lease: Lease) -> None:
        with self._lock:
            self._held -= lease.held
            lease.held = 0


class Lease:
    """The inflated bytes one body holds of the budget: taken as it inflates, given back by ``release``."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: InflateBudget) -> None:
        self.budget = budget
        self.held = 0

    def take(self, num_bytes: int) -> None:
        """:raises Overloaded: (503) the budget cannot hold ``num_bytes`` more."""
        self.budget._take(self, num_bytes)

    def release(self) -> None:
        self.budget._give_back(self)


def inflate(data: bytes, encoding: str, limit: int, lease: Lease) -> bytes:
    """``data`` inflated as ``encoding`` (one of ``ENCODINGS``) says, each MiB taken from ``lease``;
    blocking: call it in a worker thread.

    :raises InvalidRequest: ``data`` is not valid ``encoding`` data (naming ``Content-Encoding``).
    :raises PayloadTooLarge: over ``limit`` bytes inflated (as soon as it is).
    :raises Overloaded: (503) the budget is spent.
    """
    out = bytearray()
    try:
        for piece in _pieces(memoryview(data), encoding):
            if len(out) + len(piece) > limit:
                lease.budget.stats.too_large += 1
                raise PayloadTooLarge(
                    f"the request body is over the limit of {limit} bytes once inflated",
                    field="body",
                    stage="admission",
                )
            lease.take(len(piece))
            out += piece
    except zlib.error:
        message = f"the body is not valid {encoding} data, as its Content-Encoding says it is"
        raise InvalidRequest(message, field="Content-Encoding", stage="admission") from None
    lease.budget.stats.inflated += 1
    return bytes(out)


def _window_bits(encoding: str, data: memoryview) -> int:
    if encoding == "gzip":
        return 16 + zlib.MAX_WBITS
    # "deflate" is zlib-wrapped by the standard; some clients send it raw, as browsers and aiohttp accept
    return zlib.MAX_WBITS if data and data[0] & 0x0F == 8 else -zlib.MAX_WBITS


def _pieces(data: memoryview, encoding: str) -> Iterator[bytes]:
    """The inflated bytes of ``data``, at most ``_OUT_BYTES`` a piece; gzip members one after another.

    :raises zlib.error: not valid data, cut short, or trailing bytes that start no member.
    """
    pos = 0
    for _ in range(_MAX_MEMBERS):
        decoder = zlib.decompressobj(_window_bits(encoding, data[pos:]))
        while not decoder.eof:
            chunk: bytes | memoryview
            if decoder.unconsumed_tail:
                chunk = decoder.unconsumed_tail
            elif pos < len(data):
                chunk = data[pos : pos + _IN_BYTES]
                pos += len(chunk)
            else:
                raise zlib.error("the data ends before the stream does")
            piece = decoder.decompress(chunk, _OUT_BYTES)
            if piece:
                yield piece
        pos -= len(decoder.unused_data)  # bytes of the last chunk past this member's end
        rest = data[pos:]
        if not rest or (rest[0] == 0 and not rest.tobytes().strip(b"\0")):  # the end, or zero padding
            return
        if encoding != "gzip":
            raise zlib.error("data after the end of the deflate stream")
    raise zlib.error(f"more than {_MAX_MEMBERS} gzip members")
