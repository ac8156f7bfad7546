"""Stop strings over streamed text: text that might begin a stop string is held back until it
cannot, so a stop string split across two tokens never leaks into the output."""

from __future__ import annotations

__all__ = ["StopChecker"]


class StopChecker:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.hit = False

    def feed(self, delta: str) -> str:
        """The part of ``delta`` (plus held text) that is safe to emit now."""
        if self.hit:
            return ""
        if not self.stops:
            return delta
        self._pending += delta
        found = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            out, self._pending = self._pending[: min(found)], ""
            return out
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self, delta: str = "") -> str:
        """At the end of the sequence: everything still held (unless a stop string was hit)."""
        out = self.feed(delta)
        if self.hit:
            return out
        out, self._pending = out + self._pending, ""
        return out
