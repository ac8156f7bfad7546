"""A body's deadline on a clock the test moves: the bytes a body has sent earn it time; a stalled
body is out after the timeout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from pipeline.api.body_deadline import BodyDeadline


@dataclass
class _Content:
    total_bytes: int = 0


@dataclass
class _Timer:
    when: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Loop:
    now: float = 0.0
    timers: list[_Timer] = field(default_factory=list)

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(when, callback)
        self.timers.append(timer)
        return timer

    def advance(self, to: float) -> None:
        """Run every timer due by ``to`` in order, those they arm included."""
        while due := sorted((t for t in self.timers if t.when <= to and not t.cancelled), key=lambda t: t.when):
            self.now = due[0].when
            self.timers.remove(due[0])
            due[0].callback()
        self.now = to

    @property
    def pending(self) -> list[float]:
        return [t.when for t in self.timers if not t.cancelled]


def _deadline(content: _Content, loop: _Loop, expired: list[float]) -> BodyDeadline:
    return BodyDeadline(
        cast(Any, content), timeout_s=10.0, rate=100.0, expire=lambda: expired.append(loop.now), loop=cast(Any, loop)
    )


def test_a_stalled_body_is_out_at_its_timeout() -> None:
    loop, content, expired = _Loop(), _Content(total_bytes=10), []
    _deadline(content, loop, expired)
    loop.advance(9.9)
    assert expired == []
    loop.advance(60.0)  # its 10 bytes earned it 0.1 s
    assert expired == [10.1] and loop.pending == []


def test_bytes_received_earn_time_and_a_body_at_the_rate_never_runs_out() -> None:
    loop, content, expired = _Loop(), _Content(), []
    _deadline(content, loop, expired)
    for second in range(1, 60):  # 100 bytes a second: the rate
        content.total_bytes += 100
        loop.advance(float(second))
    assert expired == [] and len(loop.pending) == 1
    loop.advance(1000.0)  # then it stalls: out when the time its 5,900 bytes earned is spent
    assert expired == [69.0] and loop.pending == []


def test_a_body_read_in_time_leaves_no_timer() -> None:
    loop, content, expired = _Loop(), _Content(), []
    deadline = _deadline(content, loop, expired)
    deadline.cancel()
    loop.advance(100.0)
    assert expired == [] and loop.pending == []
