"""StepTiming: what each part of one engine step cost, for the benchmarks' step timelines and the traces."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTiming", "steps_since"]


@dataclass(slots=True)
class StepTiming:
    """Seconds spent in each part of one step.

    In the synchronous loop the parts follow each other (but ``fill``, which runs beside the forward).
    In the one-step-ahead loop ``forward``, ``apply``, ``sample`` and ``idle`` are the device thread's,
    and ``prepare``, ``fill``, ``wait``, ``accept`` and ``commit`` the host's, which runs while the
    device runs the next forward.
    """

    kind: str
    batch: int  # the sequences that sample this step (0: a prefill chunk that is not the last)
    tokens: int = 0  # the tokens the forward computes: a prefill chunk's length, a decode's batch
    start: float = 0.0  # time.perf_counter() when the step began (the same clock in every process)
    cpu: float = 0.0  # the stepping thread's CPU seconds in the step (synchronous loop): total - cpu is waiting
    forward: float = 0.0
    fill: float = 0.0  # on the fill thread, concurrent with forward
    wait: float = 0.0  # waiting for the fill after the forward (one step ahead: for the step's tokens)
    apply: float = 0.0
    sample: float = 0.0
    copy: float = 0.0
    accept: float = 0.0
    prepare: float = 0.0  # one step ahead: scheduling the step and queueing its forward, on the host
    commit: float = 0.0  # one step ahead: detokenizing, stop checks and outputs, on the host
    idle: float = 0.0  # one step ahead: the device thread waiting for the host (launch, mask)
    # synchronous loop: the step's wall time after scheduling; one step ahead: the time since the step
    # before it was committed (the cadence a stream sees, what TPOT measures)
    total: float = 0.0


def steps_since(timeline: list[StepTiming], since: float) -> list[StepTiming]:
    """The steps of ``timeline`` that began at ``since`` or later (from a snapshot: the stepping thread
    may append meanwhile)."""
    return [t for t in list(timeline) if t.start >= since]
