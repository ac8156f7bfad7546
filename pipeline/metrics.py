"""Per-stage counters and latency histograms, rendered as Prometheus text."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Histogram", "Metrics", "StageMetrics"]

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(_BUCKETS) + 1))
    total: float = 0.0
    num: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.total += seconds
        self.num += 1

    def render(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*_BUCKETS, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines += [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.num}"]
        return lines


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
    outcomes: Counter[str] = field(default_factory=Counter)  # completed / failed / cancelled / refused
    tokens_generated: int = 0
    # structured answers checked: (backend, "passed" | "failed", reason) -> count
    answer_checks: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    answer_resamples: int = 0
    grammar_cache_hits: Callable[[], int] = lambda: 0
    grammar_cache_misses: Callable[[], int] = lambda: 0
    grammar_compiles: Callable[[], Counter[str]] = Counter  # "backend: reason" -> compiles

    def stage(self, name: str) -> StageMetrics:
        return self.stages.setdefault(name, StageMetrics(name))

    def render_prometheus(self) -> str:
        out = [
            "# TYPE pipeline_stage_queue_depth gauge",
            *(f'pipeline_stage_queue_depth{{stage="{s.name}"}} {s.queue_depth()}' for s in self.stages.values()),
            "# TYPE pipeline_stage_in_flight gauge",
            *(f'pipeline_stage_in_flight{{stage="{s.name}"}} {s.in_flight}' for s in self.stages.values()),
            "# TYPE pipeline_stage_completed_total counter",
            *(f'pipeline_stage_completed_total{{stage="{s.name}"}} {s.completed}' for s in self.stages.values()),
            "# TYPE pipeline_stage_errors_total counter",
        ]
        for s in self.stages.values():
            out += [f'pipeline_stage_errors_total{{stage="{s.name}",type="{t}"}} {n}' for t, n in s.errors.items()]
        out.append("# TYPE pipeline_stage_latency_seconds histogram")
        for s in self.stages.values():
            out += s.latency.render("pipeline_stage_latency_seconds", f'stage="{s.name}"')
        out.append("# TYPE pipeline_requests_total counter")
        out += [f'pipeline_requests_total{{outcome="{k}"}} {v}' for k, v in self.outcomes.items()]
        out += [
            "# TYPE pipeline_tokens_generated_total counter",
            f"pipeline_tokens_generated_total {self.tokens_generated}",
            "# TYPE pipeline_grammar_cache_hits_total counter",
            f"pipeline_grammar_cache_hits_total {self.grammar_cache_hits()}",
            "# TYPE pipeline_grammar_cache_misses_total counter",
            f"pipeline_grammar_cache_misses_total {self.grammar_cache_misses()}",
            "# TYPE pipeline_grammar_compiles_total counter",
            *(
                f'pipeline_grammar_compiles_total{{backend="{k.split(": ", 1)[0]}",reason="{k.split(": ", 1)[1]}"}} {n}'
                for k, n in sorted(self.grammar_compiles().items())
            ),
            "# TYPE pipeline_answer_checks_total counter",
            *(
                f'pipeline_answer_checks_total{{backend="{b}",result="{r}",reason="{why}"}} {n}'
                for (b, r, why), n in sorted(self.answer_checks.items())
            ),
            "# TYPE pipeline_answer_resamples_total counter",
            f"pipeline_answer_resamples_total {self.answer_resamples}",
        ]
        return "\n".join(out) + "\n"
