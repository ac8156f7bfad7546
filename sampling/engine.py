"""LLMEngine: continuous batching with xgrammar-guided sampling; ``step()`` reads as three verbs.

``step()`` = ``schedule()``, ``launch()``, ``sample()`` and ``commit()``. In ``launch()`` the fill thread
fills the grammar bitmask for the step while the calling thread runs the forward pass (on CUDA: queues
its kernels); ``sample()`` applies the mask to the guided rows, samples and copies the tokens back;
``commit()`` accepts them into the matchers in one batched call and advances the sequences.

With ``one_step_ahead`` the same pieces run pipelined (sampling/ahead.py): the next decode's forward is
launched before the last step's tokens are committed, and the host commits them while it runs.

Every torch op of a step runs on one thread (the calling thread; one step ahead, the device thread),
the fill thread runs only xgrammar: torch's OpenMP pool belongs to the thread that calls it, and a
forward on one thread beside sampling on another gives two pools that spin against each other (on 2
cores: decode steps 30% slower).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from sampling.ahead import OneStepAhead
from sampling.detokenizer import Detokenizer, TokenBytes
from sampling.guided import GuidedDecoder, new_matcher
from sampling.inputs import EngineInput, SeqOutput
from sampling.kv_cache import BlockAllocator
from sampling.logits_process import StepLogprobs, TokenLogprob, adjust
from sampling.model_runner import ModelRunner
from sampling.overlap import HostCopier
from sampling.sampler import greedy_ids, sample
from sampling.scheduler import DecodeStep, PrefillStep, Scheduler
from sampling.sequence import SeqState, Sequence
from sampling.stop import StopChecker
from sampling.timeline import StepTiming

__all__ = ["LLMEngine", "StepTiming"]

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    inp: EngineInput
    seqs: list[Sequence] = field(default_factory=list)


class LLMEngine:
    """Synchronous engine core; drive it from one thread with ``add``, ``abort`` and ``step``."""

    def __init__(
        self,
        runner: ModelRunner,
        token_bytes: TokenBytes,
        *,
        eos_token_ids: list[int],
        num_blocks: int,
        max_running: int = 32,
        chunk_tokens: int = 2048,
        record_timeline: bool = False,
        tracer: Any = None,
        one_step_ahead: bool = False,
        prefix_caching: bool = True,
    ) -> None:
        self.runner = runner
        self.token_bytes = token_bytes
        self.eos_token_ids = eos_token_ids
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            block_size=runner.block_size,
            max_running=max_running,
            chunk_tokens=chunk_tokens,
            prefix_caching=prefix_caching,
            image_token_id=runner.image_token_id,
        )
        self.guided = GuidedDecoder(runner.cfg.vocab_size, max_running * 2, runner.device)
        self.copier = HostCopier(runner.device, max_running * 2)
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask-fill")
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.record_timeline = record_timeline
        self.lazy_mask = True  # skip the mask for greedy rows whose choice the grammar allows (exact)
        self.timeline: list[StepTiming] = []
        self.tracer = tracer  # anything with pipeline.observability.trace.Tracer's span(): one span per step
        # the decode loop one step ahead (sampling/ahead.py); None: the synchronous loop
        self.ahead = OneStepAhead(self) if one_step_ahead else None

    # -- requests ---------------------------------------------------------------------------
    def _new_seq(self, inp: EngineInput, index: int, num_siblings: int = 1) -> Sequence:
        generator = None
        if not inp.sampling.is_greedy:
            generator = torch.Generator(device=self.runner.device)
            seed = inp.sampling.seed if inp.sampling.seed is not None else torch.seed()
            generator.manual_seed((seed * 1_000_003 + index) & 0xFFFF_FFFF_FFFF_FFFF)
        return Sequence(
            seq_id=next(self._seq_ids),
            request_id=inp.request_id,
            index=index,
            prompt_ids=list(inp.prompt_token_ids),
            image_embeds=inp.image_embeds,
            params=inp.sampling,
            grammar=inp.grammar,
            detokenizer=Detokenizer(self.token_bytes),
            generator=generator,
            stop=StopChecker(inp.sampling.stop),
            num_siblings=num_siblings,
            image_keys=list(inp.image_keys),
            grammar_trigger=inp.grammar_trigger,
            grammar_start=0 if inp.grammar_trigger is None else None,
        )

    def add(self, inp: EngineInput) -> None:
        """Queue a request; its ``n`` sequences share one prefill."""
        if inp.request_id in self._requests:
            raise ValueError(f"request {inp.request_id} is already in the engine")
        seq = self._new_seq(inp, 0, inp.sampling.n)
        self._requests[inp.request_id] = _Request(inp, [seq])
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its slots, blocks and matchers now."""
        request = self._requests.pop(request_id, None)
        for seq in request.seqs if request else ():
            self.scheduler.release(seq)
            seq.matcher = None
            seq.state = SeqState.FINISHED

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.ahead is not None and self.ahead.in_flight is not None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[SeqOutput]:
        """Run one scheduled step; the outputs of every sequence that produced a token (one step ahead:
        of the step before the one it launches)."""
        if self.ahead is not None:
            return self.ahead.step()
        schedule = self.scheduler.schedule()
        refused = self._fail_unfit(schedule.unfit)
        return refused + (self._run(schedule.step) if schedule.step is not None else [])

    def _run(self, scheduled: PrefillStep | DecodeStep) -> list[SeqOutput]:
        """Launch, sample and commit one step; a step that raises fails its sequences alone."""
        timing = StepTiming("prefill" if isinstance(scheduled, PrefillStep) else "decode", 0)
        started = time.perf_counter()
        try:
            seqs, logits, filled = self._launch(scheduled, timing)
            outputs: list[SeqOutput] = []
            if seqs:
                assert logits is not None
                ids, accepted, step_logprobs = self._sample(seqs, [s.matcher for s in seqs], logits, filled, timing)
                copied = time.perf_counter()
                tokens = self.copier.start(ids)()
                timing.copy = time.perf_counter() - copied
                logprobs = step_logprobs.to_host([s.params for s in seqs], tokens) if step_logprobs else {}
                outputs = self._commit(seqs, tokens, accepted, timing, logprobs)
        except Exception as exc:  # a bug or device error: fail this step's requests, keep serving
            failed = [scheduled.seq] if isinstance(scheduled, PrefillStep) else scheduled.seqs
            return self._fail_step(failed, exc)
        ended = time.perf_counter()
        timing.total = ended - started
        self._record(timing, started, ended)
        return outputs

    def _fail_step(self, seqs: list[Sequence], exc: Exception) -> list[SeqOutput]:
        """Fail those of ``seqs`` still running (an exception in their step: a bug or a device error)."""
        failed = [s for s in seqs if s.state is not SeqState.FINISHED]
        if not failed:
            return []
        logger.error("engine step failed; failing requests %s", sorted({s.request_id for s in failed}), exc_info=exc)
        return [out for seq in failed for out in self._fail(seq, f"engine step failed: {exc!r}")]

    def _record(self, timing: StepTiming, started: float, ended: float) -> None:
        """Keep the step's timing (``record_timeline``) and trace it as a span from ``started`` to ``ended``."""
        if self.record_timeline:
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
                sample_ms=timing.sample * 1e3,
            )

    def _fail_unfit(self, unfit: list[Sequence]) -> list[SeqOutput]:
        total = self.scheduler.allocator.num_blocks * self.runner.block_size
        message = f"the sequence needs more KV cache than the whole cache holds ({total} tokens)"
        return [out for seq in unfit for out in self._fail(seq, message)]

    def _ensure_matcher(self, seq: Sequence) -> None:
        """A matcher for ``seq`` once its grammar holds, advanced over what it wrote under the grammar
        (after a preemption); none before its trigger token."""
        start = seq.grammar_start
        if seq.grammar is not None and seq.matcher is None and start is not None and seq.state is not SeqState.FINISHED:
            seq.matcher = new_matcher(seq.grammar, seq.output_ids[start:])

    def _launch(
        self, step: PrefillStep | DecodeStep, timing: StepTiming
    ) -> tuple[list[Sequence], torch.Tensor | None, list[int]]:
        """Run the step's forward with the bitmask fill beside it: the sequences that sample this
        step (none for a prefill chunk that is not the last), their logits ``[B, vocab]`` and the
        bitmask rows filled."""
        runner = self.runner
        if isinstance(step, PrefillStep):
            seq = step.seq
            chunk = seq.tokens(step.start, step.end)
            image_rows = seq.image_rows(step.start, step.end, runner.image_token_id)
            forward = functools.partial(runner.prefill, chunk, step.start, seq.block_table, image_rows)
            if not step.is_last_chunk:
                self._timed(timing, forward)
                seq.num_computed = step.end
                self.scheduler.cache_computed(seq)
                return [], None, []
            seqs = [seq]
        else:
            seqs = step.seqs
            forward = functools.partial(self._decode, seqs)
        # On the CPU the fill competes with the forward for the cores: greedy rows of a decode step try
        # their argmax on the matcher first and fill only if it is refused (see _sample).
        defer_greedy = self.lazy_mask and runner.device.type == "cpu" and isinstance(step, DecodeStep)
        guided = any(s.grammar is not None for s in seqs)
        fill = self._filler.submit(self._fill, seqs, defer_greedy, timing) if guided else None
        try:
            logits = self._timed(timing, forward)
        except BaseException:
            if fill is not None:
                futures.wait([fill])  # the fill thread must be done with these matchers before they are failed
            raise
        waited = time.perf_counter()
        filled = fill.result() if fill is not None else []
        timing.wait = time.perf_counter() - waited
        if isinstance(step, PrefillStep):
            step.seq.num_computed = step.end
            self.scheduler.cache_computed(step.seq)
            if step.seq.num_siblings > 1 and not step.seq.has_forked:
                seqs = self._fork(step.seq)
                filled = list(range(len(seqs))) if filled else []
                logits = logits.expand(len(seqs), -1).contiguous()
        else:
            for s in seqs:
                s.num_computed = s.num_tokens
        timing.batch = len(seqs)
        return seqs, logits, filled

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """The decode forward of the synchronous loop: its inputs are built beside it, on the same thread."""
        runner = self.runner
        batch = runner.decode_inputs([s.num_tokens - 1 for s in seqs], [s.block_table for s in seqs])
        return runner.decode([s.token_at(s.num_tokens - 1) for s in seqs], batch)

    def _fill(self, seqs: list[Sequence], defer_greedy: bool, timing: StepTiming) -> list[int]:
        """On the fill thread: build missing matchers and fill the step's bitmask rows (but those of
        greedy rows when ``defer_greedy``); the rows filled."""
        started = time.perf_counter()
        for s in seqs:
            self._ensure_matcher(s)
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None and not (defer_greedy and _is_lazy(s))]
        if rows:
            self.guided.fill([seqs[i].matcher for i in rows], rows)
        timing.fill = time.perf_counter() - started
        return rows

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the parent's siblings, each sharing its prefilled K/V (copying the partial last
        block) and with its own matcher."""
        request = self._requests[parent.request_id]
        children = [self._new_seq(request.inp, i) for i in range(1, parent.num_siblings)]
        for child in children:
            src, dst = self.scheduler.fork(parent, child)
            if src:
                self.runner.copy_blocks(src, dst)
            self._ensure_matcher(child)
            if child.matcher is not None:  # a fresh matcher's mask equals the parent's (row 0)
                self.guided.copy_row(0, child.index)
        parent.has_forked = True
        request.seqs += children
        return [parent, *children]

    def _timed(self, timing: StepTiming, fn, *args):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        out = fn(*args)
        if self.record_timeline and out.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # only when timing: serving never waits here
        timing.forward = time.perf_counter() - started
        return out

    def _sample(
        self,
        seqs: list[Sequence],
        matchers: list[Any | None],
        logits: torch.Tensor,
        filled: list[int],
        timing: StepTiming,
    ) -> tuple[torch.Tensor, set[int], StepLogprobs | None]:
        """Adjust, mask and sample: the ids ``[B]`` on the device, the rows whose matchers accepted theirs
        already (the lazy greedy path), and the log probabilities of the rows that ask for them.
        ``matchers`` are the rows' matchers when the step was filled (None: unguided): one step ahead,
        an abort on the host may drop a sequence's meanwhile."""
        t0 = time.perf_counter()
        params = [s.params for s in seqs]
        if any(p.logit_bias or p.has_penalties for p in params):
            adjust(logits, params, [s.output_ids for s in seqs])
        no_eos = [row for row, s in enumerate(seqs) if s.params.ignore_eos and matchers[row] is None]
        if no_eos and self.eos_token_ids:
            no_eos_rows = torch.tensor(no_eos, device=logits.device)[:, None]
            logits[no_eos_rows, torch.tensor(self.eos_token_ids, device=logits.device)] = float("-inf")
        greedy: torch.Tensor | None = None
        accepted: set[int] = set()
        masked, fill_before = filled, timing.fill
        if self.lazy_mask and logits.device.type == "cpu" and any(m is not None for m in matchers):
            greedy, accepted, masked = self._lazy_mask(seqs, matchers, logits, filled, timing)
        if masked:
            self.guided.apply(logits, masked)
            rows = [r for r in masked if seqs[r].params.is_greedy]
            if greedy is not None and rows:
                greedy[rows] = greedy_ids(logits[rows])
        t1 = time.perf_counter()
        logprobs = StepLogprobs.compute(logits, params)  # after the mask, before the temperature
        ids = sample(logits, params, [s.generator for s in seqs], greedy=greedy)
        if logprobs is not None:
            logprobs.pick(ids)
        # the lazy path's accept and fill are timed as such, not as apply
        timing.apply = t1 - t0 - timing.accept - (timing.fill - fill_before)
        timing.sample = time.perf_counter() - t1
        return ids, accepted, logprobs

    def _lazy_mask(
        self,
        seqs: list[Sequence],
        matchers: list[Any | None],
        logits: torch.Tensor,
        filled: list[int],
        timing: StepTiming,
    ) -> tuple[torch.Tensor, set[int], list[int]]:
        """Greedy rows without the full-vocabulary mask where that is exact (CPU): the argmax, the rows
        whose matchers accepted it, and the rows that still need the mask.

        A greedy row's argmax, if the grammar allows it, is also its masked argmax: a row whose fill
        was deferred offers it to its matcher (refused: the row is filled now), a filled row tests
        its bit. A row that allows few tokens takes the argmax among them.
        """
        greedy = greedy_ids(logits)
        top = greedy.tolist()
        is_filled = set(filled)
        deferred = [r for r, m in enumerate(matchers) if m is not None and r not in is_filled]
        accepted: set[int] = set()
        check = [r for r in filled if _is_lazy(seqs[r]) and not self.guided.allows(r, top[r])]
        if deferred:
            t0 = time.perf_counter()
            ok = self.guided.try_accept([matchers[r] for r in deferred], [top[r] for r in deferred])
            accepted = {r for r, good in zip(deferred, ok, strict=True) if good}
            refused = [r for r in deferred if r not in accepted]
            t1 = time.perf_counter()
            if refused:
                self.guided.fill([matchers[r] for r in refused], refused)
                check += refused
            timing.accept, timing.fill = t1 - t0, timing.fill + time.perf_counter() - t1
        masked = [r for r in filled if not _is_lazy(seqs[r])]
        for r in check:
            choice = self.guided.masked_argmax(logits, r)
            if choice is None:
                masked.append(r)
            else:
                greedy[r] = choice
        return greedy, accepted, masked

    def _commit(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        accepted_rows: set[int],
        timing: StepTiming,
        logprobs: dict[int, TokenLogprob],
    ) -> list[SeqOutput]:
        """Accept the tokens into the matchers, detokenize, check stop conditions, finish sequences."""
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
                outputs += self._fail(seq, f"token {token} was rejected by the grammar")
                continue
            outputs.append(self._advance(seq, token, logprobs.get(row)))
        return outputs

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> SeqOutput:
        seq.output_ids.append(token)
        self.scheduler.cache_computed(seq)  # before a finish frees its blocks: they stay cached
        if seq.grammar_start is None and token == seq.grammar_trigger:
            seq.grammar_start = len(seq.output_ids)  # the next step's fill builds the matcher
        is_eos = token in self.eos_token_ids and not (seq.params.ignore_eos and seq.matcher is None)
        stop = seq.stop
        text = "" if is_eos else stop.feed(seq.detokenizer.add(token))
        reason = None
        if is_eos or (seq.matcher is not None and seq.matcher.is_terminated()) or stop.hit:
            reason = "stop"
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.runner.max_model_len:
            reason = "length"
        if reason is not None:
            text += stop.flush(seq.detokenizer.flush())
            self._finish(seq, reason)
        logprobs = [logprob] if logprob is not None else None
        return SeqOutput(seq.request_id, seq.index, [token], text, reason, None, len(seq.prompt_ids), logprobs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        seq.matcher = None
        self.scheduler.release(seq)
        request = self._requests.get(seq.request_id)
        if request and all(s.state is SeqState.FINISHED for s in request.seqs):
            del self._requests[seq.request_id]

    def _fail(self, seq: Sequence, message: str) -> list[SeqOutput]:
        """Fail ``seq`` alone; a parent that fails before forking fails its unborn siblings too."""
        seq.error = message
        self._finish(seq, "error")
        unborn = range(1, seq.num_siblings) if not seq.has_forked else range(0)
        return [
            SeqOutput(seq.request_id, index, [], "", "error", message, len(seq.prompt_ids))
            for index in [seq.index, *unborn]
        ]


def _is_lazy(seq: Sequence) -> bool:
    """Whether a guided row may skip its full mask when its argmax is allowed (greedy, and no
    log probabilities, which need the whole masked distribution)."""
    return seq.params.is_greedy and seq.params.logprobs is None
