"""``Metrics`` as Prometheus metric families, through prometheus-client's custom-collector API.

The collector reads the pipeline's counters when ``/metrics`` is scraped, so counting costs
nothing more than an integer add. Names follow Prometheus' conventions: ``_total`` counters,
``_seconds`` histograms, base units, one metric per quantity with labels for its kinds.

Cache counters (encoder outputs, KV prefix blocks, the grammar cache, ...) all go to
``pipeline_cache_*{cache=...}``: a cache registers itself with ``Metrics.register_cache``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pipeline.observability.metrics import Histogram, Metrics

__all__ = ["MetricsExporter", "PipelineCollector", "build_registry"]

_REQUEST_OUTCOMES = ("completed", "failed", "cancelled", "refused")
_JOB_OUTCOMES = ("completed", "failed", "cancelled")
# AsyncEngine.stats() key -> (metric, kind, help)
_ENGINE = {
    "running_seqs": ("pipeline_engine_running_sequences", "gauge", "sequences the engine is decoding"),
    "waiting_seqs": ("pipeline_engine_waiting_sequences", "gauge", "sequences waiting for a slot or KV blocks"),
    "kv_blocks_used": ("pipeline_engine_kv_blocks_used", "gauge", "KV cache blocks in use"),
    "kv_blocks_total": ("pipeline_engine_kv_blocks", "gauge", "KV cache blocks in all"),
    "preemptions": ("pipeline_engine_preemptions", "counter", "sequences preempted to free KV blocks"),
}
_CACHE = {
    "hits": ("pipeline_cache_hits", "counter", "lookups that found an entry"),
    "misses": ("pipeline_cache_misses", "counter", "lookups that found none"),
    "evictions": ("pipeline_cache_evictions", "counter", "entries dropped to stay within the bound"),
    "bytes": ("pipeline_cache_bytes", "gauge", "bytes held"),
    "bytes_bound": ("pipeline_cache_bytes_bound", "gauge", "bytes the cache may hold"),
    "entries": ("pipeline_cache_entries", "gauge", "entries held"),
}


def _histogram(name: str, doc: str, labels: dict[str, str], hist: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), hist.cumulative(), hist.total)
    return family


def _family(name: str, kind: str, doc: str, labels: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)


class PipelineCollector(Collector):
    """Yields every metric of one pipeline at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._stages()
        yield from self._requests()
        yield from self._engine()
        yield from self._grammar()
        yield from self._caches()

    def _stages(self) -> Iterator[Metric]:
        stages = list(self.metrics.stages.values())
        depth = GaugeMetricFamily("pipeline_stage_queue_depth", "jobs waiting in the stage's inbox", labels=["stage"])
        busy = GaugeMetricFamily("pipeline_stage_in_flight", "jobs a stage worker is on", labels=["stage"])
        done = CounterMetricFamily("pipeline_stage_completed", "jobs the stage passed on", labels=["stage"])
        errors = CounterMetricFamily(
            "pipeline_stage_errors", "jobs the stage failed, by error", labels=["stage", "type"]
        )
        latency = HistogramMetricFamily(
            "pipeline_stage_latency_seconds", "time a job spent in the stage", labels=["stage"]
        )
        for s in stages:
            depth.add_metric([s.name], s.queue_depth())
            busy.add_metric([s.name], s.in_flight)
            done.add_metric([s.name], s.completed)
            for kind, count in sorted(s.errors.items()):
                errors.add_metric([s.name, kind], count)
            latency.add_metric([s.name], s.latency.cumulative(), s.latency.total)
        yield from (depth, busy, done, errors, latency)

    def _requests(self) -> Iterator[Metric]:
        m = self.metrics
        requests = CounterMetricFamily("pipeline_requests", "requests by how they ended", labels=["outcome"])
        for outcome in _REQUEST_OUTCOMES:
            requests.add_metric([outcome], m.requests[outcome])
        jobs = CounterMetricFamily(
            "pipeline_preparation_jobs", "preparation jobs by how they left the stages", labels=["outcome"]
        )
        for outcome in _JOB_OUTCOMES:
            jobs.add_metric([outcome], m.jobs[outcome])
        yield requests
        yield jobs
        yield GaugeMetricFamily("pipeline_requests_pending", "requests admitted and in the stages", value=m.pending())
        yield GaugeMetricFamily("pipeline_requests_running", "requests admitted and not yet done", value=m.running())
        yield GaugeMetricFamily(
            "pipeline_requests_waiting_for_engine",
            "prepared requests waiting for room in the engine's command queue",
            value=m.waiting_for_engine(),
        )
        yield CounterMetricFamily("pipeline_tokens_generated", "tokens sampled", value=m.tokens_generated)
        yield _histogram("pipeline_time_to_first_token_seconds", "submit to first token", {}, m.ttft)
        yield _histogram("pipeline_time_per_output_token_seconds", "per output token after the first", {}, m.tpot)

    def _engine(self) -> Iterator[Metric]:
        stats = self.metrics.engine()
        for key, (name, kind, doc) in _ENGINE.items():
            if key in stats:
                family = _family(name, kind, doc, [])
                family.add_metric([], stats[key])
                yield family

    def _grammar(self) -> Iterator[Metric]:
        m = self.metrics
        compiles = CounterMetricFamily(
            "pipeline_grammar_compiles",
            "grammars compiled, by backend and why it was chosen",
            labels=["backend", "reason"],
        )
        for key, count in sorted(m.grammar_compiles().items()):
            backend, _, reason = key.partition(": ")
            compiles.add_metric([backend, reason], count)
        yield compiles
        stats = m.grammar()
        for key, kind, doc in (
            ("errors", "counter", "specs that failed to compile"),
            ("timeouts", "counter", "waits for a compile that gave up"),
            ("compiling", "gauge", "compile jobs in flight"),
            ("compile_seconds", "counter", "seconds spent compiling"),
        ):
            if key in stats:
                family = _family(f"pipeline_grammar_{key}", kind, doc, [])
                family.add_metric([], stats[key])
                yield family
        checks = CounterMetricFamily(
            "pipeline_answer_checks", "structured answers checked", labels=["backend", "result", "reason"]
        )
        for (backend, result, reason), count in sorted(m.answer_checks.items()):
            checks.add_metric([backend, result, reason], count)
        yield checks
        yield CounterMetricFamily("pipeline_answer_resamples", "answers sampled again", value=m.answer_resamples)

    def _caches(self) -> Iterator[Metric]:
        families = {key: _family(name, kind, doc, ["cache"]) for key, (name, kind, doc) in _CACHE.items()}
        seen: set[str] = set()
        for cache, source in self.metrics.caches.items():
            for key, value in source().items():
                if key in families:
                    families[key].add_metric([cache], value)
                    seen.add(key)
        yield from (families[key] for key in _CACHE if key in seen)


def build_registry(metrics: Metrics) -> CollectorRegistry:
    """A registry of its own for ``metrics`` (never the global one: a process may run many pipelines)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PipelineCollector(metrics))
    return registry


class MetricsExporter:
    """The Prometheus side of one ``Metrics``: its own registry, rendered when ``/metrics`` is scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self.registry = build_registry(metrics)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
