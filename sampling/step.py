"""The parts of one engine step, the surface both decode loops drive: schedule, launch, fill, sample, commit, record.

``run()`` is a whole step of the synchronous loop: ``launch()`` runs the forward (on CUDA: queues its
kernels) while the fill thread fills the step's grammar bitmask (``fill()``; the matchers, the fill
thread and a compile still running: sampling/guided/step_grammar.py); ``sample()`` applies the
mask to the guided rows and samples (sampling/masked_sampler.py); the ids come back to the host
(``start_copy()``); ``commit()`` accepts them into the matchers in one batched call and advances the
sequences (sampling/request_table.py); ``record()`` keeps the step's timing. The one-step-ahead loop
(sampling/ahead.py) drives the same parts in another order: ``decode()`` and ``sample()`` on its device
thread, ``fill()`` and ``commit()`` on the host while the next forward runs, and ``run()`` for the
prefills it does not run ahead. Neither loop reaches past these parts, so each can change alone.

Threads: every torch op of a step runs on one thread (the calling thread; one step ahead, the device
thread), and the fill thread runs only the grammar backends' fill (xgrammar, llguidance), no torch op:
torch's OpenMP pool belongs to the thread that calls it, and a forward on one thread beside sampling on
another gives two pools that spin against each other (on 2 cores: decode steps 30% slower). Hence the
parts that touch tensors (``launch``, ``decode``, ``sample``, ``start_copy``) and those that do not
(``fill``, ``commit``) are apart.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import torch

from sampling.decode_buffers import DecodeBuffers
from sampling.guided.decoder import GrammarUnavailable, refusal
from sampling.guided.forced import ForcedTokens
from sampling.guided.step_grammar import StepGrammar
from sampling.inputs import SeqOutput
from sampling.logits_process import StepLogprobs, TokenLogprob
from sampling.masked_sampler import MaskedSampler
from sampling.model_runner import ModelRunner
from sampling.overlap import HostCopier
from sampling.prefill_chunks import prefill_forward
from sampling.request_table import RequestTable
from sampling.scheduler import DecodeStep, PrefillBatch, PrefillStep, Scheduler
from sampling.sequence import SeqState, Sequence
from sampling.timeline import StepTiming

__all__ = ["StepParts"]

logger = logging.getLogger(__name__)

# With nothing to run but sequences held for their grammars' compiles, the loop waits this long at
# most for one to end before it looks at its commands again (a new request waits no longer)
_GRAMMAR_WAIT_S = 0.002


class StepParts:
    """The parts of a step over the engine's runner, scheduler, requests and sampler; one per engine."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        requests: RequestTable,
        sampler: MaskedSampler,
        *,
        max_rows: int,
        record_timeline: bool = False,
        tracer: Any = None,
        forced: ForcedTokens | None = None,
        buffers: DecodeBuffers | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.requests = requests
        self.sampler = sampler
        self.guided = sampler.guided
        self.grammar = StepGrammar(sampler.guided)
        self.copier = HostCopier(runner.device, max_rows)
        self.record_timeline = record_timeline
        self.timeline: list[StepTiming] = []
        self.tracer = tracer  # anything with pipeline.observability.trace.Tracer's span(): one span per step
        # what each guided sequence's grammar forces after its sampled token, written at commit (None: one
        # token per step); the one-step-ahead loop commits with none (its next step is launched by then)
        self.forced = forced
        self.num_forced = 0  # tokens written so (a counter for tests and benchmarks)
        # the decode steps' inputs in tensors allocated once, batches padded to buckets (what a CUDA
        # graph replays); None: each step's inputs built afresh at its own size (decode_inputs)
        self.buffers = buffers

    def schedule(self) -> tuple[PrefillStep | PrefillBatch | DecodeStep | None, list[SeqOutput]]:
        """The next step (None: nothing can run), and the outputs of the sequences failed as unfit on the way."""
        schedule = self.scheduler.schedule()
        if schedule.step is None and not schedule.unfit:
            self.scheduler.await_grammars(_GRAMMAR_WAIT_S)
        total = self.scheduler.allocator.num_blocks * self.runner.block_size
        message = f"the sequence needs more KV cache than the whole cache holds ({total} tokens)"
        return schedule.step, [out for seq in schedule.unfit for out in self.requests.fail(seq, message)]

    def run(self, step: PrefillStep | PrefillBatch | DecodeStep) -> list[SeqOutput]:
        """Launch, sample and commit one step; a step that raises fails its sequences alone. A batched
        prefill whose launch raises runs each of its parts apart first (``run_apart``), so that one
        request's fault fails that request, not every prompt that shared its forward."""
        timing = StepTiming("decode" if isinstance(step, DecodeStep) else "prefill", 0)
        observed = self.record_timeline or self.tracer is not None  # the CPU clock only when read
        if isinstance(step, DecodeStep):
            timing.tokens = len(step.seqs)
        elif isinstance(step, PrefillStep):
            timing.tokens = step.end - step.start
        else:
            timing.tokens = len(step.decodes) + sum(c.end - c.start for c in step.chunks)
            timing.kind = "mixed" if step.decodes else "prefill"
        started, cpu_started = time.perf_counter(), time.thread_time() if observed else 0.0
        try:
            seqs, logits, filled = self.launch(step, timing)
        except Exception as exc:
            if isinstance(step, PrefillBatch) and len(step.chunks) + len(step.decodes) > 1:
                return self.run_apart(step, exc)
            return self.fail_step([step.seq] if isinstance(step, PrefillStep) else step.seqs, exc)
        try:
            outputs: list[SeqOutput] = []
            if seqs:
                assert logits is not None
                ids, accepted, step_logprobs = self.sample(seqs, [s.matcher for s in seqs], logits, filled, timing)
                copied = time.perf_counter()
                tokens = self.start_copy(ids)()
                timing.copy = time.perf_counter() - copied
                logprobs = step_logprobs.to_host([s.params for s in seqs], tokens) if step_logprobs else {}
                outputs = self.commit(seqs, tokens, accepted, timing, logprobs)
        except Exception as exc:  # a bug or device error: fail this step's requests, keep serving
            return self.fail_step([step.seq] if isinstance(step, PrefillStep) else step.seqs, exc)
        ended = time.perf_counter()
        timing.total = ended - started
        if observed:
            timing.cpu = time.thread_time() - cpu_started
        self.record(timing, started, ended)
        return outputs

    def run_apart(self, batch: PrefillBatch, exc: Exception) -> list[SeqOutput]:
        """After ``batch``'s launch raised ``exc``: each of its chunks as a step of its own, then its
        decodes as one decode step. Nothing of the batch was committed (a launch samples and accepts
        nothing, and what it records, the chunks' computed K/V, is recorded again by the step that
        reruns it), so every part runs as if the batch had never been. A fault of the device fails
        every part, at the cost of a forward each."""
        logger.warning("a batched prefill of %d parts raised %r; running its parts apart", len(batch.seqs), exc)
        steps: list[PrefillStep | DecodeStep] = [*batch.chunks, *([DecodeStep(batch.decodes)] if batch.decodes else [])]
        return [out for part in steps for out in self.run(part)]

    def launch(
        self, step: PrefillStep | PrefillBatch | DecodeStep, timing: StepTiming
    ) -> tuple[list[Sequence], torch.Tensor | None, list[int]]:
        """Run the step's forward with the bitmask fill beside it: the sequences that sample this
        step (none for prefill chunks that end no prompt), their logits ``[B, vocab]`` and the
        bitmask rows filled."""
        chunks: list[PrefillStep] = []
        if isinstance(step, DecodeStep):
            seqs = step.seqs
            forward: Callable[[], torch.Tensor] = functools.partial(self._decode, seqs)
        else:
            chunks = [step] if isinstance(step, PrefillStep) else step.chunks
            forward = prefill_forward(self.runner, step)
            seqs = [
                *(step.decodes if isinstance(step, PrefillBatch) else []),
                *(c.seq for c in chunks if c.is_last_chunk),
            ]
            if not seqs:
                self.timed(timing, forward)
                self._computed(chunks, [])
                return [], None, []
        # a step of decodes and forced tokens' extends samples as a decode does (its matchers are built)
        is_decode = isinstance(step, DecodeStep) or (isinstance(step, PrefillBatch) and step.extends)
        defer_greedy = is_decode and self.defers_greedy()
        forward_done: Future[None] = Future()
        fill = self.grammar.start_fill(seqs, defer_greedy, timing, forward_done)
        try:
            logits = self.timed(timing, forward)
        except BaseException:
            if fill is not None:
                forward_done.set_result(None)
                futures.wait([fill])  # the fill thread must be done with these matchers before they are failed
            raise
        forward_done.set_result(None)
        waited = time.perf_counter()
        sampled, filled = fill.result() if fill is not None else (seqs, [])
        timing.wait = time.perf_counter() - waited
        deferred: list[Sequence] = []
        if len(sampled) < len(seqs):  # grammars still compile: their sequences sample in a later step
            kept = {id(s) for s in sampled}
            deferred = [s for s in seqs if id(s) not in kept]
            logits = logits[[i for i, s in enumerate(seqs) if id(s) in kept]]
            seqs = sampled
        if chunks:
            self._computed(chunks, deferred)
            for s in step.decodes if isinstance(step, PrefillBatch) else []:
                s.num_computed = s.num_tokens
            # n > 1 forks only from a chunk of its own (the scheduler never batches it)
            if isinstance(step, PrefillStep) and step.seq.num_siblings > 1 and not step.seq.has_forked and seqs:
                seqs = self._fork(step.seq)
                filled = list(range(len(seqs))) if filled else []
                logits = logits.expand(len(seqs), -1).contiguous()
        else:
            for s in seqs:
                s.num_computed = s.num_tokens
        timing.batch = len(seqs)
        return seqs, logits, filled

    def _computed(self, chunks: list[PrefillStep], deferred: list[Sequence]) -> None:
        """The chunks' K/V is in the cache, but for the last token of a ``deferred`` sequence: it runs
        again, in the chunk that samples once the grammar has compiled (so no block is registered
        for prefix hits with a token computed twice)."""
        for chunk in chunks:
            is_deferred = any(chunk.seq is d for d in deferred)
            chunk.seq.num_computed = chunk.end - 1 if is_deferred else chunk.end
            self.scheduler.cache_computed(chunk.seq)

    def decode(
        self,
        ids: list[int] | torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
        rope_deltas: list[int] | None = None,
    ) -> torch.Tensor:
        """The decode forward of ``ids`` at ``positions``: its inputs are built beside it, on the same thread.
        ``rope_deltas``: each row's M-RoPE offset (its RoPE position is its position plus it)."""
        if self.buffers is not None:  # the padded step, its padding rows' logits dropped
            padded_ids, batch = self.buffers.view(self.buffers.load(ids, positions, tables, rope_deltas))
            return self.runner.decode(padded_ids, batch)[: len(positions)]
        batch = self.runner.decode_inputs(positions, tables)
        if rope_deltas is not None and any(rope_deltas):
            rope = torch.tensor([p + d for p, d in zip(positions, rope_deltas, strict=True)])
            batch.rope_positions = rope.expand(3, -1).to(self.runner.device)
        return self.runner.decode(ids, batch)

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        positions = [s.num_tokens - 1 for s in seqs]
        return self.decode(
            [s.token_at(p) for s, p in zip(seqs, positions, strict=True)],
            positions,
            [s.block_table for s in seqs],
            [s.rope_delta for s in seqs],
        )

    def timed(self, timing: StepTiming, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """``fn(*args)``, the step's forward, timed as such."""
        started = time.perf_counter()
        out = fn(*args)
        if self.record_timeline and out.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # only when timing: serving never waits here
        timing.forward = time.perf_counter() - started
        return out

    def fill(self, seqs: list[Sequence], defer_greedy: bool, timing: StepTiming) -> list[int]:
        """Build missing matchers and fill the step's bitmask rows (StepGrammar.fill): the rows filled."""
        return self.grammar.fill(seqs, defer_greedy, timing)

    def defers_greedy(self) -> bool:
        """Whether a decode's fill leaves its greedy rows to ``sample`` (MaskedSampler.defers_greedy)."""
        return self.sampler.defers_greedy(self.runner.device)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the parent and its siblings, each sharing its prefilled K/V (copying the partial last
        block) and with its own matcher."""
        children = self.requests.siblings(parent)
        for child in children:
            src, dst = self.scheduler.fork(parent, child)
            if src:
                self.runner.copy_blocks(src, dst)
            self.grammar.ensure_matcher(child)
            if child.matcher is not None:  # a fresh matcher's mask equals the parent's (row 0)
                self.guided.copy_row(0, child.index)
        self.requests.adopt(parent, children)
        return [parent, *children]

    def sample(
        self,
        seqs: list[Sequence],
        matchers: list[Any | None],
        logits: torch.Tensor,
        filled: list[int],
        timing: StepTiming,
    ) -> tuple[torch.Tensor, set[int], StepLogprobs | None]:
        """The ids ``[B]`` on the device, the rows accepted already and the log probabilities (MaskedSampler.sample)."""
        return self.sampler.sample(seqs, matchers, logits, filled, timing)

    def start_copy(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        """Begin copying ``ids`` ``[B]`` to the host; the returned function waits and gives the list."""
        return self.copier.start(ids)

    def commit(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        accepted_rows: set[int],
        timing: StepTiming,
        logprobs: dict[int, TokenLogprob],
        *,
        force: bool = True,
    ) -> list[SeqOutput]:
        """Accept the tokens into the matchers (but ``accepted_rows``'), detokenize, check stop conditions,
        finish sequences: their outputs. With ``force`` (and ``forced``), each sequence's forced tokens
        follow its token, in the same output."""
        t0 = time.perf_counter()
        guided = [i for i, s in enumerate(seqs) if s.matcher is not None and i not in accepted_rows]
        accepted = dict(
            zip(
                guided,
                self.guided.accept([seqs[i].matcher for i in guided], [tokens[i] for i in guided]),
                strict=True,
            )
        )
        timing.accept += time.perf_counter() - t0
        outputs = []
        for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if not accepted.get(row, True):
                message, kind = refusal(seq.matcher, token)
                logger.error("request %s: %s", seq.request_id, message)
                outputs += self.requests.fail(seq, message, kind)
                continue
            out = self.requests.advance(seq, token, logprobs.get(row))
            if force and self.forced is not None and self._may_force(seq, out):
                out = self._force(seq, out)
            outputs.append(out)
        return outputs

    @staticmethod
    def _may_force(seq: Sequence, out: SeqOutput) -> bool:
        """Whether ``seq``, which just wrote ``out``, takes forced tokens: running under its grammar,
        and asking for nothing a forced token would bypass (log probabilities, computed where a token
        is sampled; bans, applied to sampled tokens)."""
        params = seq.params
        return out.finish_reason is None and seq.matcher is not None and params.logprobs is None and not params.has_bans

    def _force(self, seq: Sequence, out: SeqOutput) -> SeqOutput:
        """``out`` followed by what ``seq``'s grammar forces, each token accepted and committed as a
        sampled one is (a stop string, ``max_tokens`` or the model's length may end it early)."""
        assert self.forced is not None and seq.matcher is not None
        forced = self.forced.after(seq.matcher, seq.output_ids)
        for token in forced:
            # a token that ends the answer is sampled, never forced; a refusal (never, but for a backend
            # that misspoke) leaves the rest to be sampled
            if token in seq.params.stop_token_ids or not seq.matcher.accept_token(token):
                break
            self.num_forced += 1
            more = self.requests.advance(seq, token)
            out.token_ids += more.token_ids
            out.text += more.text
            out.finish_reason = more.finish_reason
            if more.finish_reason is not None:
                break
        return out

    def fail_step(self, seqs: list[Sequence], exc: Exception) -> list[SeqOutput]:
        """Fail those of ``seqs`` still running (an exception in their step: a bug or a device error)."""
        failed = [s for s in seqs if s.state is not SeqState.FINISHED]
        if not failed:
            return []
        if isinstance(exc, GrammarUnavailable):  # a refused constraint, not a fault: its sender answers for it
            return [out for seq in failed for out in self.requests.fail(seq, str(exc), "constraint")]
        logger.error("engine step failed; failing requests %s", sorted({s.request_id for s in failed}), exc_info=exc)
        return [out for seq in failed for out in self.requests.fail(seq, f"engine step failed: {exc!r}")]

    def record(self, timing: StepTiming, started: float, ended: float) -> None:
        """Keep the step's timing (``record_timeline``) and trace it as a span from ``started`` to ``ended``."""
        if self.record_timeline:
            timing.start = started
            self.timeline.append(timing)
        if self.tracer is not None:
            self.tracer.span(
                timing.kind,
                "step",
                None,
                started,
                ended,
                batch=timing.batch,
                forward_ms=timing.forward * 1e3,
                fill_ms=timing.fill * 1e3,
                wait_ms=timing.wait * 1e3,
                apply_ms=timing.apply * 1e3,
                sample_ms=timing.sample * 1e3,
                copy_ms=timing.copy * 1e3,
                accept_ms=timing.accept * 1e3,
                cpu_ms=timing.cpu * 1e3,
            )
