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


def _split_intervals(steps: list[StepTiming]) -> tuple[list[float], list[float]]:
    """The intervals between consecutive decode steps: those with a prefill step between them, and
    those without (a decoding stream's tokens, with and without another request's prefill)."""
    with_prefill: list[float] = []
    clean: list[float] = []
    last: float | None = None
    prefilled = False
    for step in sorted(steps, key=lambda s: s.start):
        if step.kind == "prefill":
            prefilled = True
            continue
        if last is not None:
            (with_prefill if prefilled else clean).append(step.start - last)
        last, prefilled = step.start, step.kind == "mixed"  # its prefill delays the next token
    return with_prefill, clean


def summarise(windows: list[WindowSteps]) -> dict[str, float]:
    """Figures over ``windows`` together: per-step medians (ms), shares of the windows' wall time."""
    wall = sum(w.end - w.start for w in windows)
    # a mixed step (decodes and prefill chunks in one forward) counts as both
    decodes = [s for w in windows for s in w.steps if s.kind in ("decode", "mixed")]
    prefills = [s for w in windows for s in w.steps if s.kind in ("prefill", "mixed")]
    intervals = [g for w in windows for g in _intervals([s.start for s in w.steps if s.kind in ("decode", "mixed")])]
    split = [_split_intervals(w.steps) for w in windows]
    with_prefill = [g for w, _ in split for g in w]
    clean = [g for _, c in split for g in c]
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
        "prefill_step_ms": round(median([s.total for s in prefills]) * 1e3, 3) if prefills else nan,
        "prefill_step_cpu_ms": round(median([s.cpu for s in prefills]) * 1e3, 3) if prefills else nan,
        # the decode intervals a prefill step fell into, and the others: what a prefill costs a stream
        "intervals_with_prefill": len(with_prefill),
        "interval_with_prefill_ms": round(median(with_prefill) * 1e3, 3) if with_prefill else nan,
        "interval_clean_ms": round(median(clean) * 1e3, 3) if clean else nan,
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
    "prefill step p50 ms",
    "prefill cpu p50 ms",
    "intervals with prefill",
    "with prefill p50 ms",
    "without p50 ms",
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
        "prefill_step_ms",
        "prefill_step_cpu_ms",
        "intervals_with_prefill",
        "interval_with_prefill_ms",
        "interval_clean_ms",
        "prefills_per_decode",
        "decode_share",
        "prefill_share",
        "outside_share",
    )
    return [prep, engine, kind, phase, *(figures[k] for k in keys)]
