"""Stage spans of every request as Chrome trace events (open the file in Perfetto or chrome://tracing).

Each request gets its own track (admission, every stage's queue wait and work, grammar compile,
decode); the engine's steps (prefill, decode) get one track of their own. Appending to a list is
atomic under the GIL, so the engine thread records without a lock; an engine process's steps arrive
with its step outputs and the event loop records them (``perf_counter`` is one clock for both).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["Tracer"]

_ENGINE_TRACK = 0


class Tracer:
    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._next_track = itertools.count(1)

    def now(self) -> float:
        return time.perf_counter()

    def _track(self, key: str) -> int:
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = next(self._next_track)
            self._events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": track, "args": {"name": key}})
        return track

    def span(self, name: str, cat: str, request_id: str | None, start: float, end: float, **args: Any) -> None:
        """A complete event from ``start`` to ``end`` (``perf_counter`` seconds) on the request's track."""
        self._events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": (start - self._t0) * 1e6,
                "dur": max(0.0, end - start) * 1e6,
                "pid": 1,
                "tid": self._track(request_id) if request_id else _ENGINE_TRACK,
                "args": args,
            }
        )

    def instant(self, name: str, request_id: str | None, **args: Any) -> None:
        ts = (time.perf_counter() - self._t0) * 1e6
        tid = self._track(request_id) if request_id else _ENGINE_TRACK
        self._events.append({"name": name, "ph": "i", "s": "t", "ts": ts, "pid": 1, "tid": tid, "args": args})

    def write(self, path: str | Path) -> None:
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": _ENGINE_TRACK, "args": {"name": "engine steps"}}]
        Path(path).write_text(json.dumps({"traceEvents": meta + list(self._events), "displayTimeUnit": "ms"}))

    @property
    def num_events(self) -> int:
        return len(self._events)
