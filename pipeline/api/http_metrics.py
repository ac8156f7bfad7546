"""The server's own counters on ``/metrics``: its connections (``ConnectionGuard``) and the bodies it
paced (``BodyPacer``), read when ``/metrics`` is scraped, beside the pipeline's.

A pipeline served by several listeners (ports) exports one family per metric, summed over them: a
name may appear only once in an exposition.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.api.body_pacing import BodyPacer
from pipeline.api.connections import ConnectionGuard
from pipeline.core.pipeline import Pipeline

__all__ = ["HttpCollector", "exported"]

# one collector per served pipeline, whatever the number of its listeners
_COLLECTORS: weakref.WeakKeyDictionary[Pipeline, HttpCollector] = weakref.WeakKeyDictionary()


class HttpCollector(Collector):
    """Yields the metrics of a pipeline's listeners at scrape time."""

    def __init__(self) -> None:
        self.listeners: list[tuple[ConnectionGuard, BodyPacer]] = []

    def _total(self, read: Callable[[ConnectionGuard, BodyPacer], int]) -> int:
        return sum(read(guard, bodies) for guard, bodies in self.listeners)

    def collect(self) -> Iterator[Metric]:
        total = self._total
        yield GaugeMetricFamily("pipeline_http_connections_open", "connections open", total(lambda g, _: g.num_open))
        connections = CounterMetricFamily(
            "pipeline_http_connections",
            "connections: opened, refused at the cap, evicted, head timed out",
            labels=["outcome"],
        )
        connections.add_metric(["opened"], total(lambda g, _: g.stats.opened))
        connections.add_metric(["refused"], total(lambda g, _: g.stats.refused))
        connections.add_metric(["evicted"], total(lambda g, _: g.stats.evicted))
        connections.add_metric(["header_timeout"], total(lambda g, _: g.stats.header_timeouts))
        yield connections
        yield CounterMetricFamily(
            "pipeline_http_reserve_refusals",
            "requests on a reserve connection for another path than /health",
            total(lambda g, _: g.stats.reserve_refusals),
        )
        yield GaugeMetricFamily(
            "pipeline_http_bodies_reading", "request bodies being read", total(lambda _, b: b.num_reading)
        )
        yield GaugeMetricFamily(
            "pipeline_http_bodies_waiting",
            "request bodies waiting for a slot to be read",
            total(lambda _, b: b.num_waiting),
        )
        yield CounterMetricFamily(
            "pipeline_http_bodies_paced", "request bodies read under a slot", total(lambda _, b: b.stats.bodies)
        )
        yield CounterMetricFamily(
            "pipeline_http_bodies_waited",
            "request bodies that waited for their slot",
            total(lambda _, b: b.stats.waited),
        )
        yield CounterMetricFamily(
            "pipeline_http_body_slots_given_up",
            "slots given up by bodies that arrived slower than the minimum rate",
            total(lambda _, b: b.stats.slow),
        )


@contextmanager
def exported(pipe: Pipeline, guard: ConnectionGuard, bodies: BodyPacer) -> Iterator[None]:
    """Count a listener's connections and bodies on ``pipe``'s ``/metrics`` for the block."""
    collector = _COLLECTORS.get(pipe)
    if collector is None:
        collector = _COLLECTORS[pipe] = HttpCollector()
        pipe.add_metrics(collector)
    listener = (guard, bodies)
    collector.listeners.append(listener)
    try:
        yield
    finally:
        collector.listeners.remove(listener)
        if not collector.listeners:
            pipe.remove_metrics(collector)
            del _COLLECTORS[pipe]
