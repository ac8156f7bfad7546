"""Engine step timelines for the benchmarks: what the running decodes wait for inside a time window.

A stream's time per output token is the time between two decode steps. Within a window, that time
splits into the decode steps themselves, the prefill steps between them (another request's prompt
sharing the engine), and the time outside any step (the engine loop reading commands and sending
outputs, or waiting: for a core, or in thread mode for the GIL). ``cpu`` is the stepping thread's
own CPU time, so a step whose wall time far exceeds it waited for a core or the GIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.bench.common import median, percentile
from sampling.timeline import StepTiming

__all__ = ["WindowSteps", "summarise", "timeline_row", "TIMELINE_HEADERS"]


@dataclass(slots=True)
class WindowSteps:
    """The engine steps that began in one window, and the window's bounds (``time.perf_counter()``)."""

    start: float
    end: float
    steps: list[StepTiming]


def _intervals(starts: list[float]) -> list[float]:
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


def summarise(windows: list[WindowSteps]) -> dict[str, float]:
    """Figures over ``windows`` together: per-step medians (ms), shares of the windows' wall time."""
    wall = sum(w.end - w.start for w in windows)
    decodes = [s for w in windows for s in w.steps if s.kind == "decode"]
    prefills = [s for w in windows for s in w.steps if s.kind == "prefill"]
    intervals = [g for w in windows for g in _intervals([s.start for s in w.steps if s.kind == "decode"])]
    in_steps = sum(min(s.total, w.end - s.start) for w in windows for s in w.steps)  # a step may outlast its window
    nan = float("nan")
    return {
        "wall_s": round(wall, 3),
        "decode_steps": len(decodes),
        "decode_interval_ms": round(median(intervals) * 1e3, 3) if intervals else nan,
        "decode_interval_p99_ms": round(percentile(intervals, 99) * 1e3, 3) if intervals else nan,
        "decode_step_ms": round(median([s.total for s in decodes]) * 1e3, 3) if decodes else nan,
        "decode_step_cpu_ms": round(median([s.cpu for s in decodes]) * 1e3, 3) if decodes else nan,
        "decode_batch": median([float(s.batch) for s in decodes]) if decodes else nan,
        "prefill_steps": len(prefills),
        "prefill_tokens": sum(s.tokens for s in prefills),
        "prefill_step_max_ms": round(max(s.total for s in prefills) * 1e3, 3) if prefills else nan,
        "prefills_per_decode": round(len(prefills) / len(decodes), 3) if decodes else nan,
        "decode_share": round(sum(s.total for s in decodes) / wall, 3) if wall else nan,
        "prefill_share": round(sum(s.total for s in prefills) / wall, 3) if wall else nan,
        "outside_share": round(1 - in_steps / wall, 3) if wall else nan,
    }


TIMELINE_HEADERS = [
    "preparation",
    "engine",
    "images",
    "phase",
    "decode steps",
    "decode interval p50 ms",
    "p99 ms",
    "decode step p50 ms",
    "decode cpu p50 ms",
    "prefill steps",
    "prefill tokens",
    "prefill max ms",
    "prefill/decode",
    "wall in decode",
    "wall in prefill",
    "wall outside steps",
]


def timeline_row(prep: str, engine: str, kind: str, phase: str, figures: dict[str, Any]) -> list[Any]:
    """One row of the step-timeline table under ``TIMELINE_HEADERS``."""
    keys = (
        "decode_steps",
        "decode_interval_ms",
        "decode_interval_p99_ms",
        "decode_step_ms",
        "decode_step_cpu_ms",
        "prefill_steps",
        "prefill_tokens",
        "prefill_step_max_ms",
        "prefills_per_decode",
        "decode_share",
        "prefill_share",
        "outside_share",
    )
    return [prep, engine, kind, phase, *(figures[k] for k in keys)]
