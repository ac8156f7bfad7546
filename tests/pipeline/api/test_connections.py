"""The connection guard alone: placement, room made at the cap, refusals, one log line per interval."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from pipeline.api.connections import ConnectionGuard, ConnectionLimits, fitted

LIMITS = ConnectionLimits(max_connections=4, reserved_connections=1, log_interval_s=10.0)


class Conn:
    def __init__(self) -> None:
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.timers.append((self.now + delay, callback))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, callback in due:
            callback()


def test_places_general_then_reserve_then_makes_room_from_the_longest_waiting() -> None:
    guard = ConnectionGuard(LIMITS, Clock(), Clock().call_later)
    conns = [Conn() for _ in range(5)]
    assert [guard.admit(c) for c in conns[:4]] == ["general", "general", "general", "reserve"]
    guard.busy(conns[0])  # has a request: not evicted
    assert guard.admit(conns[4]) == "reserve"
    assert [c.evicted for c in conns] == [False, True, False, False, False]
    assert (guard.num_open, guard.stats.evicted, guard.stats.refused) == (4, 1, 0)


def test_refuses_when_every_connection_has_a_request() -> None:
    guard = ConnectionGuard(LIMITS, Clock(), Clock().call_later)
    conns = [Conn() for _ in range(4)]
    for c in conns:
        guard.admit(c)
        guard.busy(c)
    assert guard.admit(Conn()) is None
    assert guard.stats.refused == 1 and not any(c.evicted for c in conns)
    guard.waiting(conns[2])  # answered, idle on keep-alive: the first to go
    guard.closed(conns[0])
    assert guard.admit(Conn()) == "reserve" and guard.admit(Conn()) == "reserve"
    assert conns[2].evicted and guard.stats.evicted == 1


def test_refusals_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    guard = ConnectionGuard(LIMITS, clock, clock.call_later)
    for c in [Conn() for _ in range(4)]:
        guard.admit(c)
        guard.busy(c)
    with caplog.at_level(logging.WARNING, logger="pipeline.api.connections"):
        for _ in range(1_000):
            guard.admit(Conn())
        assert len(caplog.records) == 1  # the first refusal at once, the rest wait for the interval
        clock.advance(5.0)
        assert len(caplog.records) == 1
        clock.advance(5.0)
        assert len(caplog.records) == 2 and "999 refused" in caplog.records[1].getMessage()
        clock.advance(60.0)
        assert len(caplog.records) == 2  # nothing new: no line
    assert guard.stats.refused == 1_000


def test_the_cap_is_lowered_to_fit_the_open_file_limit() -> None:
    assert fitted(LIMITS, 100_000) == LIMITS
    small = fitted(ConnectionLimits(max_connections=4096, reserved_connections=16), 1024)
    assert small.max_connections == 1024 - 256 and small.reserved_connections == 16


@pytest.mark.parametrize(
    "bad",
    [
        {"max_connections": 1},
        {"reserved_connections": 0},
        {"max_connections": 4, "reserved_connections": 4},
        {"header_timeout_s": 0},
    ],
)
def test_limits_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ConnectionLimits(**bad)  # type: ignore[arg-type]
