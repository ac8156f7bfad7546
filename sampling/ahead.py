"""The decode loop one step ahead: the next forward is launched before the last step's tokens reach the host.

The synchronous loop leaves the device idle while the host commits a step:

    host:    schedule t, inputs | fill t |        | wait | accept t, detokenize, stop checks | schedule t+1 ...
    device:                     | forward t       | mask, sample t |          (idle)        | forward t+1

One step ahead, each ``step()`` schedules step t+1 and launches its forward (queued on the device behind
step t), then commits step t while that forward runs, fills step t+1's bitmask from the matchers as
they now are, and queues step t+1's masking and sampling behind its forward:

    host:    schedule t+1, inputs | wait t | accept t, detokenize, stop checks | fill t+1 | return t's outputs
    device:  mask, sample t       | forward t+1 ........................................ | mask, sample t+1 |

- Step t+1's input ids are step t's samples, still on the device. Its mask comes from the matchers after
  they accepted step t's tokens and is applied to its logits before it samples: guided sequences stay
  exact, and seeded ones draw the same noise per token as in the synchronous loop.
- A sequence that finishes at step t (EOS, a stop string, the end of its grammar) is already in step
  t+1: it leaves at t+2 and its step t+1 token is discarded: never streamed, counted, or accepted by a
  matcher. One whose length limit falls on its in-flight token is left out of step t+1 instead. An
  aborted sequence's in-flight token is discarded the same way; a rejected token fails its sequence.
- Only decodes run ahead. When ``Scheduler.schedule_ahead()`` declines (a prefill chunk to run, n > 1
  children to fork, room to make by preempting, a sequence to fail), the loop drains: it commits the
  in-flight step and launches nothing, and the next ``step()`` runs the synchronous schedule, a prefill
  synchronously. Preemption and matcher replay therefore never meet a token in flight.
- An exception in a step (on either thread) fails the step's sequences when it is collected; the step
  launched behind it finds them finished.

The loop drives the step's parts (``StepParts``, sampling/step.py) as the synchronous loop does, in
another order and on two threads, and runs ``StepParts.run()`` for a prefill; it knows nothing of the
engine that owns it (``LLMEngine`` hands it its parts).

Threads: every torch op of the engine runs on the ``DeviceQueue``'s thread, the forward's inputs
(``ModelRunner.decode_inputs``) included; the host thread runs the scheduler, the matchers (whose
batched calls release the GIL) and the detokenizer. On the CPU the forward is the device: its torch ops
release the GIL, but it dispatches ~100 of them per step from Python, and every torch call on the host
would hand the GIL back and forth with them (each handoff wakes a thread: 40-75 us on the 2-core VM
measured, where a ``submit`` + ``result`` round trip takes 84 us). Building the inputs on the host:
TPOT ratio to the synchronous loop 0.993 at batch 32, on the device thread 0.916 (12 interleaved runs).

What it buys depends on the device. On a GPU the host work of a step runs while the GPU computes. On
the 2-core CPU it hides 0.3-0.8 ms of host work per step (3-5% of a step that is 93-95% forward), but
that work then competes with the forward for the cores (two OpenMP threads) and the GIL, and the
forward slows by about as much: see ``python -m pipeline bench ahead``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from sampling.inputs import SeqOutput
from sampling.logits_process import StepLogprobs
from sampling.overlap import DeviceQueue
from sampling.scheduler import DecodeStep, PrefillBatch, PrefillStep
from sampling.sequence import SeqState, Sequence
from sampling.step import StepParts
from sampling.timeline import StepTiming

__all__ = ["OneStepAhead"]

# wait for the ids on the host; rows accepted already; the rows' log probabilities (on the device)
Sampled = tuple[Callable[[], list[int]], set[int], StepLogprobs | None]


@dataclass(slots=True, eq=False)
class _InFlight:
    """A decode step launched on the device whose tokens the host has not committed yet."""

    seqs: list[Sequence]
    timing: StepTiming
    launched: float
    logits: Future[torch.Tensor] | None = None
    sampled: Future[Sampled] | None = None
    ids: torch.Tensor | None = None  # [B] its samples on the device (set there): the next step's inputs
    error: Exception | None = None  # raised on the host while launching or filling it


class OneStepAhead:
    """The decode loop one step ahead over an engine's ``StepParts``; ``LLMEngine.step()`` calls ``step()``."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.device = DeviceQueue()
        self.in_flight: _InFlight | None = None
        self._last_commit = 0.0
        # counters (tests, benchmarks): decodes launched behind another step, drains, tokens dropped
        self.num_ahead = 0
        self.num_drains = 0
        self.num_discarded = 0

    def step(self) -> list[SeqOutput]:
        """Launch the step after the one in flight, then commit the one in flight; its outputs."""
        started = time.perf_counter()
        previous = self.in_flight
        scheduled, refused = self._schedule(previous)
        if isinstance(scheduled, PrefillStep | PrefillBatch):  # only with nothing in flight: synchronously
            return refused + self.device.call(self.parts.run, scheduled)
        current = self._launch(scheduled, previous, started) if scheduled is not None else None
        outputs = self._collect(previous) if previous is not None else []
        if current is not None:
            self._fill_and_sample(current)
        self.in_flight = current
        return refused + outputs

    def _schedule(
        self, previous: _InFlight | None
    ) -> tuple[PrefillStep | PrefillBatch | DecodeStep | None, list[SeqOutput]]:
        """The next step, and the outputs of sequences failed as unfit on the way. With a step in flight
        only a decode of its sequences can follow it; None drains the loop."""
        if previous is None:
            return self.parts.schedule()
        step = self.parts.scheduler.schedule_ahead(self._wants_more)
        self.num_drains += step is None
        return step, []

    def _wants_more(self, seq: Sequence) -> bool:
        """Whether ``seq`` may run another step after its in-flight token: that token does not reach
        its ``max_tokens`` or the model's length (then it finishes on commit, as ``RequestTable.advance`` decides)."""
        num_outputs = len(seq.output_ids) + seq.num_in_flight
        return num_outputs < seq.params.max_tokens and seq.num_tokens_launched < self.parts.runner.max_model_len

    def _launch(self, step: DecodeStep, previous: _InFlight | None, started: float) -> _InFlight:
        """Queue ``step``'s forward on the device, behind ``previous`` (``started``: when its scheduling began)."""
        seqs = step.seqs
        positions = [s.num_tokens_launched - 1 for s in seqs]
        current = _InFlight(seqs, StepTiming("decode", len(seqs)), started)
        self.num_ahead += previous is not None
        for seq, position in zip(seqs, positions, strict=True):
            seq.num_computed = position + 1
            seq.num_in_flight += 1
        try:
            if previous is None:  # the committed last tokens
                inputs = [s.token_at(p) for s, p in zip(seqs, positions, strict=True)]
            else:  # rows of the previous step's samples, which every sequence ahead has a token in
                row_of = {id(s): row for row, s in enumerate(previous.seqs)}
                inputs = [row_of[id(s)] for s in seqs]
            tables = [list(s.block_table) for s in seqs]  # as they are now: the scheduler grows them in place
            deltas = [s.rope_delta for s in seqs]
            current.logits = self.device.submit(self._forward, current, previous, inputs, positions, tables, deltas)
        except Exception as exc:  # failed when collected, like an exception on the device
            current.error = exc
        current.timing.prepare = time.perf_counter() - started
        return current

    def _forward(
        self,
        step: _InFlight,
        previous: _InFlight | None,
        inputs: list[int],
        positions: list[int],
        tables: list[list[int]],
        deltas: list[int],
    ) -> torch.Tensor:
        """On the device thread: ``step``'s forward; ``inputs`` are token ids, or rows of ``previous``'s samples."""
        step.timing.idle += self.device.idle_before()
        return self.parts.timed(step.timing, self._decode, previous, inputs, positions, tables, deltas)

    def _decode(
        self,
        previous: _InFlight | None,
        inputs: list[int],
        positions: list[int],
        tables: list[list[int]],
        deltas: list[int],
    ) -> torch.Tensor:
        if previous is None:
            ids: list[int] | torch.Tensor = inputs
        elif previous.ids is None:
            raise RuntimeError("the step before this one failed: its tokens are not there")
        else:
            ids = previous.ids if inputs == list(range(len(previous.seqs))) else previous.ids[inputs]
        return self.parts.decode(ids, positions, tables, deltas)

    def _fill_and_sample(self, step: _InFlight) -> None:
        """Fill ``step``'s bitmask from the matchers as they are now, while its forward runs, then queue
        its masking and sampling behind the forward. Finished sequences (their tokens will be dropped)
        are neither filled nor masked."""
        if step.error is not None:
            return
        parts = self.parts
        try:
            # every step here is a decode: on the CPU its greedy rows try their argmax before any fill
            filled = parts.fill(step.seqs, parts.defers_greedy(), step.timing) if self._is_guided(step) else []
            matchers = [s.matcher if s.state is SeqState.RUNNING else None for s in step.seqs]
            step.sampled = self.device.submit(self._sample, step, matchers, filled)
        except Exception as exc:
            step.error = exc

    @staticmethod
    def _is_guided(step: _InFlight) -> bool:
        return any(s.grammar is not None and s.state is SeqState.RUNNING for s in step.seqs)

    def _sample(self, step: _InFlight, matchers: list[Any | None], filled: list[int]) -> Sampled:
        """On the device thread: mask and sample ``step``, keep the ids for the next step's inputs and
        start their copy to the host."""
        assert step.logits is not None
        step.timing.idle += self.device.idle_before()
        logits = step.logits.result()  # done: the forward ran before this job, on this thread
        step.logits = None  # [B, vocab]: not kept alive beside the next step's
        ids, accepted, logprobs = self.parts.sample(step.seqs, matchers, logits, filled, step.timing)
        step.ids = ids
        return self.parts.start_copy(ids), accepted, logprobs

    def _collect(self, step: _InFlight) -> list[SeqOutput]:
        """Wait for ``step``'s tokens and commit those of its sequences still running."""
        waited = time.perf_counter()
        try:
            if step.error is not None:
                raise step.error
            assert step.sampled is not None
            wait, accepted, step_logprobs = step.sampled.result()
            tokens = wait()
            logprobs = step_logprobs.to_host([s.params for s in step.seqs], tokens) if step_logprobs else {}
        except Exception as exc:
            return self.parts.fail_step(step.seqs, exc)
        finally:
            for seq in step.seqs:
                seq.num_in_flight -= 1
        committed = time.perf_counter()
        timing = step.timing
        timing.wait = committed - waited
        live = [row for row, s in enumerate(step.seqs) if s.state is SeqState.RUNNING]
        self.num_discarded += len(step.seqs) - len(live)
        outputs = self.parts.commit(
            [step.seqs[row] for row in live],
            [tokens[row] for row in live],
            {i for i, row in enumerate(live) if row in accepted},
            timing,
            {i: logprobs[row] for i, row in enumerate(live) if row in logprobs},
            force=False,  # the next step is launched already, one token after this one
        )
        ended = time.perf_counter()
        timing.commit = ended - committed
        # from the step before's commit: the cadence a stream sees, and trace spans that do not overlap
        begun = max(self._last_commit, step.launched)
        timing.total = ended - begun
        self._last_commit = ended
        self.parts.record(timing, begun, ended)
        return outputs
