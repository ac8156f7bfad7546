"""What the pipeline counts: plain counters and histograms, updated on the event loop.

Updating them costs an integer add (no lock: only the loop writes them). This module knows no
exporter: ``pipeline.observability.prometheus`` reads the counters when ``/metrics`` is scraped and
writes the Prometheus text through prometheus-client, one ``CollectorRegistry`` per ``Metrics``
(tests run many pipelines in one process).

Requests and preparation jobs are counted apart: a request (``requests``) ends once, completed,
failed, cancelled, or refused at admission; its preparation job (``jobs``) ends when it leaves the
stages, and a request cancelled while joining its grammar leaves a completed job behind.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["CacheStatsSource", "Histogram", "Metrics", "StageMetrics"]

STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)

#: A cache's counters by name (``hits``, ``misses``, and where known ``evictions``, ``bytes``,
#: ``entries``), read at scrape time; see ``Metrics.register_cache``.
CacheStatsSource = Callable[[], Mapping[str, float]]


@dataclass
class Histogram:
    buckets: tuple[float, ...] = STAGE_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, then one over the last bound
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds
        self.num += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: (upper bound, observations at or under it), ending with ``+Inf``."""
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


@dataclass
class StageMetrics:
    name: str
    queue_depth: Callable[[], int] = lambda: 0
    in_flight: int = 0
    completed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latency: Histogram = field(default_factory=Histogram)


@dataclass
class Metrics:
    stages: dict[str, StageMetrics] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)  # completed / failed / cancelled / refused
    jobs: Counter[str] = field(default_factory=Counter)  # preparation: completed / failed / cancelled
    tokens_generated: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # submit to first token
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))  # per token after the first
    # structured answers checked: (backend, "passed" | "failed", reason) -> count
    answer_checks: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    answer_resamples: int = 0
    grammar_compiles: Callable[[], Counter[str]] = Counter  # "backend: reason" -> compiles
    grammar: Callable[[], Mapping[str, float]] = dict  # errors, timeouts, compiling, compile_seconds
    # gauges read at scrape time, set by the Pipeline
    pending: Callable[[], int] = lambda: 0  # admitted, in the stages
    running: Callable[[], int] = lambda: 0  # handles not yet done
    waiting_for_engine: Callable[[], int] = lambda: 0  # prepared, waiting for room in the engine's queue
    engine: Callable[[], Mapping[str, int]] = dict  # AsyncEngine.stats()
    caches: dict[str, CacheStatsSource] = field(default_factory=dict)

    def stage(self, name: str) -> StageMetrics:
        return self.stages.setdefault(name, StageMetrics(name))

    def register_cache(self, name: str, stats: CacheStatsSource) -> None:
        """Export a cache's counters as ``pipeline_cache_*{cache=name}`` (encoder outputs, KV prefix
        blocks, ...): ``stats()`` returns ``hits`` and ``misses``, and where known ``evictions``,
        ``bytes`` and ``entries``."""
        self.caches[name] = stats

    def observe_decode(self, first_token_s: float, decode_s: float, num_tokens: int) -> None:
        """One finished request: time to its first token, and per output token after it."""
        self.ttft.observe(first_token_s)
        if num_tokens > 1:
            self.tpot.observe(decode_s / (num_tokens - 1))
