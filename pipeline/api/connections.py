"""Bounded connections: how many the server holds open, how long each may take to send a request
head, and what happens at the cap.

- **Header deadline**: a request's head (request line and headers) must arrive whole within
  ``header_timeout_s`` of the connection opening, or of its first byte after a keep-alive pause;
  otherwise the server answers 408 and closes. An idle keep-alive connection closes after
  ``keepalive_timeout_s``.
- **Cap with a reserve**: at most ``max_connections`` are open. The last ``reserved_connections``
  of them answer ``/health`` only (anything else is a 503 and a close), so a probe gets in when
  the rest are taken. At the cap, the connection that has waited longest for a request head is
  closed to make room (slow and idle clients lose first); when none waits, the new one is refused
  with a 503. Connections beyond the cap never reach ``accept()`` failures: the file-descriptor
  limit is raised at start and the cap is kept under it.
- **Bodies a few at a time**: at most ``max_reading_bodies`` request bodies are read at once, the
  others wait in arrival order with their connections paused, and a body that arrives slower than
  ``min_body_rate`` gives its slot up (``pipeline/api/body_pacing.py``).
- **Body deadline**: a body must arrive whole within ``body_timeout_s`` of its head (a wait for a
  body slot counts), plus a second for each ``body_timeout_rate`` bytes received, so a large body
  sent at that rate or faster never times out and a stalled one is answered 408 and closed
  (``pipeline/api/body_deadline.py``).
- **Counted, logged once per interval**: refusals, evictions and header timeouts are counted in
  ``ConnectionStats`` and logged as one summary line per ``log_interval_s``, never per connection.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["ConnectionGuard", "ConnectionLimits", "ConnectionStats", "Place", "raise_fd_limit"]

logger = logging.getLogger(__name__)

Place = Literal["general", "reserve"]
# descriptors kept free of connections: worker pipes, shared memory, image fetches, model files
FD_HEADROOM = 256


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The server's connection bounds; the defaults are what ``python -m pipeline serve`` uses."""

    max_connections: int = 4096  # open at once, the reserve included (lowered to fit the fd limit)
    reserved_connections: int = 16  # of those, kept for /health
    header_timeout_s: float = 10.0  # for a request head to arrive whole
    keepalive_timeout_s: float = 75.0  # an idle keep-alive connection closes after this
    log_interval_s: float = 10.0  # at most one summary line of refusals per interval
    max_reading_bodies: int = 2  # request bodies read at once (pipeline/api/body_pacing.py)
    min_body_rate: float = 4e6  # bytes a second: a body that arrives slower reads on without its slot
    body_timeout_s: float = 30.0  # for a request body to arrive whole, beyond what its bytes earn
    body_timeout_rate: float = 64 * 1024  # bytes a second: each such second of bytes received earns a second

    def __post_init__(self) -> None:
        if self.max_connections < 2:
            raise ValueError(f"max_connections must be at least 2, got {self.max_connections}")
        if not 1 <= self.reserved_connections < self.max_connections:
            raise ValueError(f"reserved_connections must be in [1, max_connections), got {self.reserved_connections}")
        if self.max_reading_bodies < 1:
            raise ValueError(f"max_reading_bodies must be at least 1, got {self.max_reading_bodies}")
        for name in (
            "header_timeout_s",
            "keepalive_timeout_s",
            "log_interval_s",
            "min_body_rate",
            "body_timeout_s",
            "body_timeout_rate",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class ConnectionStats:
    """What the bounds did since the server started."""

    opened: int = 0  # admitted, the reserve included
    refused: int = 0  # closed at once: the cap was reached and no connection waited
    evicted: int = 0  # closed while waiting for a request head, to make room at the cap
    header_timeouts: int = 0  # closed because a request head did not arrive in time
    body_timeouts: int = 0  # closed because a request body did not arrive in time
    reserve_refusals: int = 0  # requests on a reserve connection for another path than /health


class Held(Protocol):
    """A connection as the guard sees it."""

    def evict(self) -> None:
        """Close it now: it waits for a request head and its slot is needed."""


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # a sandbox may forbid it: keep the soft limit
            logger.warning("could not raise the open-file limit from %d to %d (%s)", soft, hard, exc)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft


def fitted(limits: ConnectionLimits, fd_limit: int) -> ConnectionLimits:
    """``limits`` with the cap lowered, if need be, to leave ``FD_HEADROOM`` descriptors free."""
    room = fd_limit - FD_HEADROOM
    if fd_limit == resource.RLIM_INFINITY or limits.max_connections <= room:
        return limits
    cap = max(room, 2)
    reserve = min(limits.reserved_connections, max(1, cap // 8))
    logger.warning(
        "open-file limit %d: at most %d connections (not %d), %d of them for /health",
        fd_limit,
        cap,
        limits.max_connections,
        reserve,
    )
    return dataclasses.replace(limits, max_connections=cap, reserved_connections=reserve)


class ConnectionGuard:
    """Counts open connections, places each (general or reserve), makes room at the cap, and logs
    what it refused once per interval. ``clock`` is the event loop's ``time``; ``call_later`` its
    ``call_later`` (the summary of the last interval is flushed even when no refusal follows)."""

    def __init__(
        self,
        limits: ConnectionLimits,
        clock: Callable[[], float],
        call_later: Callable[[float, Callable[[], None]], object],
    ) -> None:
        self.limits = limits
        self.stats = ConnectionStats()
        self._clock = clock
        self._call_later = call_later
        self._open: set[Held] = set()
        self._waiting: OrderedDict[Held, None] = OrderedDict()  # oldest wait first
        self._last_log = -limits.log_interval_s
        self._logged = ConnectionStats()  # the stats as of the last summary line
        self._flush_pending = False

    @property
    def num_open(self) -> int:
        return len(self._open)

    def admit(self, conn: Held) -> Place | None:
        """Where ``conn`` goes: a general slot, a reserve one (``/health`` only), or None (refused)."""
        limits = self.limits
        if len(self._open) >= limits.max_connections:
            if not self._waiting:
                self.stats.refused += 1
                self._note()
                return None
            oldest, _ = self._waiting.popitem(last=False)
            self._open.discard(oldest)
            self.stats.evicted += 1
            self._note()
            oldest.evict()
        place: Place = "general"
        if len(self._open) >= limits.max_connections - limits.reserved_connections:
            place = "reserve"
        self._open.add(conn)
        self._waiting[conn] = None
        self.stats.opened += 1
        return place

    def waiting(self, conn: Held) -> None:
        """``conn`` waits for a request head (new, or idle between requests): it may be evicted."""
        if conn in self._open:
            self._waiting[conn] = None
            self._waiting.move_to_end(conn)

    def busy(self, conn: Held) -> None:
        """``conn`` has a request head: it is not evicted until it waits again."""
        self._waiting.pop(conn, None)

    def closed(self, conn: Held) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)

    def timed_out(self) -> None:
        self.stats.header_timeouts += 1
        self._note()

    def body_timed_out(self) -> None:
        self.stats.body_timeouts += 1
        self._note()

    def refused_request(self) -> None:
        self.stats.reserve_refusals += 1
        self._note()

    def _note(self) -> None:
        if self._flush_pending:
            return
        wait = self._last_log + self.limits.log_interval_s - self._clock()
        if wait <= 0:
            self._flush()
        else:
            self._flush_pending = True
            self._call_later(wait, self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        self._last_log = self._clock()
        now, then = self.stats, self._logged
        logger.warning(
            "connection limits (%d open of %d, %d reserved for /health), since the last report: %d refused "
            "at the cap, %d closed to make room, %d closed by the %g s header deadline, %d closed by the "
            "body deadline, %d requests refused on reserve connections",
            len(self._open),
            self.limits.max_connections,
            self.limits.reserved_connections,
            now.refused - then.refused,
            now.evicted - then.evicted,
            now.header_timeouts - then.header_timeouts,
            self.limits.header_timeout_s,
            now.body_timeouts - then.body_timeouts,
            now.reserve_refusals - then.reserve_refusals,
        )
        self._logged = dataclasses.replace(now)
