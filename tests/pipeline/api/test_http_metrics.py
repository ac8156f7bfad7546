"""The listener's counters on /metrics, summed over a pipeline's listeners: a listener that leaves
keeps its counts in the sums, so no counter goes down; its gauges leave with it."""

from __future__ import annotations

from pipeline.api.body_pacing import BodyPacer
from pipeline.api.connections import ConnectionGuard, ConnectionLimits
from pipeline.api.http_metrics import HttpCollector


class _Connection:
    def evict(self) -> None:
        raise AssertionError("not evicted here")


def _listener(opened: int, paced: int) -> tuple[ConnectionGuard, BodyPacer]:
    guard = ConnectionGuard(ConnectionLimits(), lambda: 0.0, lambda *_: None)  # type: ignore[arg-type, return-value]
    bodies = BodyPacer(2, 1024.0)
    guard.stats.opened, bodies.stats.bodies = opened, paced
    return guard, bodies


def _samples(collector: HttpCollector) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(s.name, tuple(s.labels.values())): s.value for family in collector.collect() for s in family.samples}


def test_a_leaving_listener_keeps_its_counts_and_takes_its_gauges() -> None:
    collector = HttpCollector()
    first, second = _listener(opened=5, paced=3), _listener(opened=1000, paced=7)
    collector.listeners += [first, second]
    assert _samples(collector)[("pipeline_http_connections_total", ("opened",))] == 1005
    assert second[0].admit(_Connection()) is not None  # one more opened, and open, on the second port

    before = _samples(collector)
    assert before[("pipeline_http_connections_open", ())] == 1
    collector.retire(second)
    after = _samples(collector)
    assert before[("pipeline_http_connections_total", ("opened",))] == 1006
    assert after[("pipeline_http_connections_total", ("opened",))] == 1006
    assert after[("pipeline_http_bodies_paced_total", ())] == 10
    assert after[("pipeline_http_connections_open", ())] == 0

    first[0].stats.opened += 1  # the remaining listener counts on from the sum
    assert _samples(collector)[("pipeline_http_connections_total", ("opened",))] == 1007
