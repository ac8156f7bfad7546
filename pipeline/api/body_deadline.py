"""The deadline of one request body: it must arrive whole within ``timeout_s`` of the app asking
for it (right after its head; a wait for a body slot counts), plus one second for each ``rate``
bytes received by then.

A header deadline alone let a client send its head and 10 of 1,000 body bytes, then nothing: the
connection stayed open for good, and 4,100 such clients (0.5 MB sent in all) filled the connection
cap. A fixed deadline alone would refuse a large body on a slow link, so the bytes a body has sent
earn it time: one sent at ``rate`` or faster never times out, a stalled one (a chunk-size line
promising 2 GB, then 1 KB, then nothing) is out after about ``timeout_s``. The deadline is checked
when it falls due, never on every read: a body that arrives in time costs one timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import StreamReader

__all__ = ["BodyDeadline"]


class BodyDeadline:
    """Calls ``expire`` once if ``content`` has not ended when its deadline passes; ``cancel()``
    when the body has been read. Event loop only."""

    def __init__(
        self,
        content: StreamReader,
        timeout_s: float,
        rate: float,
        expire: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._content = content
        self._timeout_s = timeout_s
        self._rate = rate
        self._expire = expire
        self._loop = loop
        self._started = loop.time()
        self._timer: asyncio.TimerHandle | None = loop.call_at(self._started + timeout_s, self._check)

    @property
    def due(self) -> float:
        """When the body is out of time, on the loop's clock, given the bytes received so far."""
        return self._started + self._timeout_s + self._content.total_bytes / self._rate

    def _check(self) -> None:
        due = self.due
        if self._loop.time() < due:  # bytes arrived meanwhile and earned more time
            self._timer = self._loop.call_at(due, self._check)
            return
        self._timer = None
        self._expire()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
