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


_Read = Callable[[ConnectionGuard, BodyPacer], int]

# the counters, by name: a listener that leaves keeps its counts in the sums (a counter never goes down)
_COUNTERS: dict[str, _Read] = {
    "opened": lambda g, _: g.stats.opened,
    "refused": lambda g, _: g.stats.refused,
    "evicted": lambda g, _: g.stats.evicted,
    "header_timeout": lambda g, _: g.stats.header_timeouts,
    "body_timeout": lambda g, _: g.stats.body_timeouts,
    "reserve_refusals": lambda g, _: g.stats.reserve_refusals,
    "paced": lambda _, b: b.stats.bodies,
    "waited": lambda _, b: b.stats.waited,
    "given_up": lambda _, b: b.stats.slow,
}


class HttpCollector(Collector):
    """Yields the metrics of a pipeline's listeners at scrape time."""

    def __init__(self) -> None:
        self.listeners: list[tuple[ConnectionGuard, BodyPacer]] = []
        self.retired = dict.fromkeys(_COUNTERS, 0)  # the counts of listeners that have left

    def retire(self, listener: tuple[ConnectionGuard, BodyPacer]) -> None:
        self.listeners.remove(listener)
        for name, read in _COUNTERS.items():
            self.retired[name] += read(*listener)

    def _live(self, read: _Read) -> int:
        """The sum over the listeners still open."""
        return sum(read(guard, bodies) for guard, bodies in self.listeners)

    def _count(self, name: str) -> int:
        return self.retired[name] + self._live(_COUNTERS[name])

    def collect(self) -> Iterator[Metric]:
        count = self._count
        yield GaugeMetricFamily(
            "pipeline_http_connections_open", "connections open", self._live(lambda g, _: g.num_open)
        )
        connections = CounterMetricFamily(
            "pipeline_http_connections",
            "connections: opened, refused at the cap, evicted, head or body timed out",
            labels=["outcome"],
        )
        for outcome in ("opened", "refused", "evicted", "header_timeout", "body_timeout"):
            connections.add_metric([outcome], count(outcome))
        yield connections
        yield CounterMetricFamily(
            "pipeline_http_reserve_refusals",
            "requests on a reserve connection for another path than /health",
            count("reserve_refusals"),
        )
        yield GaugeMetricFamily(
            "pipeline_http_bodies_reading", "request bodies being read", self._live(lambda _, b: b.num_reading)
        )
        yield GaugeMetricFamily(
            "pipeline_http_bodies_waiting",
            "request bodies waiting for a slot to be read",
            self._live(lambda _, b: b.num_waiting),
        )
        yield CounterMetricFamily("pipeline_http_bodies_paced", "request bodies read under a slot", count("paced"))
        yield CounterMetricFamily(
            "pipeline_http_bodies_waited", "request bodies that had to wait for a slot (read or not)", count("waited")
        )
        yield CounterMetricFamily(
            "pipeline_http_body_slots_given_up",
            "slots given up by bodies that arrived slower than the minimum rate",
            count("given_up"),
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
        collector.retire(listener)
        if not collector.listeners:
            pipe.remove_metrics(collector)
            del _COLLECTORS[pipe]
