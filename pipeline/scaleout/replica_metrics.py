"""One Prometheus exposition from many replicas: each sample gains a ``replica`` label.

A scale-out endpoint answers ``/metrics`` for all its replicas at once, so one scrape target shows
where requests went and which replica's caches hit. The parts are the replicas' own expositions
(``prometheus_client`` text format); samples of one metric family from every replica are gathered
into that family, as the format requires.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["merge_expositions"]


class _Merged:
    """A collector that yields the parsed families once each, samples of every replica within."""

    def __init__(self, parts: Mapping[str, bytes]) -> None:
        self.families: dict[str, Metric] = {}
        for replica, text in sorted(parts.items()):
            for family in text_string_to_metric_families(text.decode()):
                merged = self.families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                merged.samples += [
                    Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                ]

    def collect(self) -> Iterator[Metric]:
        yield from self.families.values()


def merge_expositions(parts: Mapping[str, bytes]) -> bytes:
    """The text exposition of every replica's metrics (``parts``: replica name → its exposition)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(parts))
    return generate_latest(registry)
