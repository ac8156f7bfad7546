"""The step timeline's summary: a decode interval counts as "with prefill" when a prefill step
began inside it, and the prefill steps' wall and CPU medians."""

from __future__ import annotations

from pipeline.bench.step_timeline import WindowSteps, summarise
from sampling.timeline import StepTiming


def _step(kind: str, start: float, total: float, cpu: float) -> StepTiming:
    return StepTiming(kind, 1, tokens=4, start=start, total=total, cpu=cpu)


def test_intervals_split_by_the_prefills_between_decodes() -> None:
    steps = [
        _step("decode", 0.000, 0.008, 0.007),
        _step("decode", 0.010, 0.008, 0.007),  # 10 ms, clean
        _step("prefill", 0.018, 0.012, 0.010),
        _step("decode", 0.032, 0.008, 0.007),  # 22 ms, a prefill between
        _step("decode", 0.042, 0.008, 0.007),  # 10 ms, clean
        _step("prefill", 0.050, 0.006, 0.004),
        _step("prefill", 0.056, 0.006, 0.004),
        _step("decode", 0.064, 0.008, 0.007),  # 22 ms, two prefills between: one interval
    ]
    figures = summarise([WindowSteps(0.0, 0.072, steps)])
    assert figures["intervals_with_prefill"] == 2
    assert figures["interval_with_prefill_ms"] == 22.0
    assert figures["interval_clean_ms"] == 10.0
    assert figures["prefill_steps"] == 3
    assert figures["prefill_step_ms"] == 6.0 and figures["prefill_step_cpu_ms"] == 4.0
