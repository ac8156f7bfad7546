"""RequestHandle: one submitted request: stream its deltas, await its result, or cancel it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio

from pipeline.answer.answer_gate import AnswerGate, resample_params
from pipeline.answer.call_split import CallSplit
from pipeline.answer.choice import Choice, Delta, Result
from pipeline.answer.reasoning_split import ReasoningSplit
from pipeline.errors import EngineError, GrammarError, PipelineError, RequestCancelled
from pipeline.observability.metrics import Metrics
from pipeline.observability.trace import Tracer
from pipeline.outcome import Mailbox, Outcome
from pipeline.protocol.request import ChatRequest
from sampling.inputs import EngineInput, SeqOutput
from stages.grammar.types import CompiledConstraint
from stages.reasoning import ReasoningFormat

logger = logging.getLogger(__name__)

__all__ = ["Choice", "Delta", "PreparedInput", "RequestHandle", "Result"]


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedInput:
    """A request ready to decode: the engine's input, and the constraint its answers are checked
    against (None when unconstrained, or still compiling: then ``verdict`` brings it)."""

    inp: EngineInput
    constraint: CompiledConstraint | None
    # the compile's outcome when the request goes to the engine before it ends: no token may leave
    # before it is in, and a refusal is the request's error (its sequences never sample)
    verdict: Outcome[CompiledConstraint | None] | None = None
    # a reasoning model prompted to reason first: its tags, to split each answer's reasoning off
    reasoning: ReasoningFormat | None = None


class RequestHandle:
    """Returned by ``Pipeline.submit()``; iterate for deltas, ``await result()``, or ``cancel()``."""

    def __init__(
        self,
        request: ChatRequest,
        engine: Any,
        metrics: Metrics,
        *,
        tracer: Tracer | None = None,
        resample_attempts: int = 2,
    ) -> None:
        self._resample_attempts = resample_attempts  # per choice whose answer fails its check
        self._tracer = tracer
        self.request = request
        self.request_id = request.request_id
        self._engine = engine
        self._metrics = metrics
        n = request.sampling.n
        self._reasoning: ReasoningFormat | None = None  # set once prepared: see ``PreparedInput.reasoning``
        self._choices = [self._new_choice(i) for i in range(n)]
        self._deltas: Mailbox[Delta] = Mailbox()  # bounded by max_tokens * n
        self._outcome: Outcome[Result] = Outcome()
        self._error: PipelineError | None = None
        self._scope = anyio.CancelScope()
        self._prompt_tokens = 0
        self._timings: dict[str, float] = {}
        self._grammar_backend: str | None = None
        self._num_resamples = 0

    def _new_choice(self, index: int) -> Choice:
        plan = self.request.tools
        if plan is not None and plan.spans_answer:
            choice = Choice(index, split=CallSplit(plan.format.marker or ""))
        else:
            choice = Choice(index, call_text="" if plan is not None and plan.starts_with_call else None)
        if self._reasoning is not None:
            choice.thinking, choice.reasoning = ReasoningSplit(self._reasoning), ""
        return choice

    @property
    def _marker(self) -> str:
        """The text of the token that opens the calls (none without tools)."""
        plan = self.request.tools
        return (plan.format.marker or "") if plan is not None else ""

    def _checked(self, choice: Choice) -> str | None:
        """What the answer check reads of ``choice``; None: it has nothing to check."""
        plan = self.request.tools
        if plan is not None and plan.spans_answer:
            return choice.answer  # the grammar held over text and calls alike
        return choice.call_text if plan is not None else choice.text

    async def run(self, prepared: Awaitable[PreparedInput]) -> None:
        """Prepare, then decode; every exit ends the handle with exactly one outcome."""
        started = anyio.current_time()
        outcome = "completed"
        try:
            with self._scope:
                ready = await prepared
                inp = ready.inp
                self._timings.update(inp.timings)
                self._prompt_tokens = len(inp.prompt_token_ids)
                if ready.reasoning is not None:
                    self._reasoning = ready.reasoning
                    self._choices = [self._new_choice(c.index) for c in self._choices]
                gate = self._gate(ready.constraint)
                gate = await self._decode(inp, started, gate, ready.verdict)
                if gate is not None and gate.failed:
                    await self._resample(inp, gate)
            if self._scope.cancel_called and self._error is None:
                self._error = RequestCancelled("the request was cancelled", request_id=self.request_id)
        except PipelineError as exc:
            self._error = exc.bind(request_id=self.request_id)
        except Exception as exc:  # a bug: a 500 for this request only, logged once with its traceback
            logger.exception("request %s failed with an unexpected error", self.request_id)
            self._error = PipelineError(f"internal error ({type(exc).__name__})", request_id=self.request_id)
        finally:
            if self._error is not None:
                outcome = "cancelled" if isinstance(self._error, RequestCancelled) else "failed"
            self._metrics.requests[outcome] += 1
            self._timings["total"] = total = anyio.current_time() - started
            first = self._timings.get("first_token")
            if self._error is None and first is not None:
                num_tokens = max(len(c.token_ids) for c in self._choices)  # the n choices decode side by side
                self._metrics.observe_decode(first, total - first, num_tokens)
            self._end()

    def _end(self) -> None:
        self._deltas.close(self._error)
        if self._error is None:
            self._outcome.set_result(
                Result(
                    request_id=self.request_id,
                    choices=self._choices,
                    prompt_tokens=self._prompt_tokens,
                    completion_tokens=sum(len(c.token_ids) for c in self._choices),
                    timings=self._timings,
                    grammar_backend=self._grammar_backend,
                    num_resamples=self._num_resamples,
                )
            )
        elif isinstance(self._error, RequestCancelled):
            self._outcome.cancel(self._error)
        else:
            self._outcome.fail(self._error)

    def _gate(self, constraint: CompiledConstraint | None) -> AnswerGate[Delta] | None:
        """The check of the answers under ``constraint`` (None: unconstrained)."""
        if constraint is None:
            return None
        self._grammar_backend = constraint.backend
        spec = self.request.grammar
        return AnswerGate(
            constraint.check,
            constraint.backend,
            self.request.stream,
            self._metrics.answer_checks,
            constraint_field=spec.field if spec is not None else None,
        )

    async def _decode(
        self,
        inp: EngineInput,
        started: float,
        gate: AnswerGate | None,
        verdict: Outcome[CompiledConstraint | None] | None = None,
    ) -> AnswerGate | None:
        """Stream the engine's outputs through ``gate``; with ``verdict`` (the grammar still compiled
        when the request went to the engine), its gate once the compile is in, before any token
        leaves (a refusal raises its error: the engine's sequences never sampled). The gate used."""
        choices = self._choices
        async for out in self._generate(inp, verdict):
            if verdict is not None:
                gate, verdict = self._gate(verdict.get()), None  # in: _generate waited for it
                self._timings.update(inp.timings)  # the compile's time, in since
            if "first_token" not in self._timings:
                self._timings["first_token"] = anyio.current_time() - started
                if self._tracer is not None:
                    self._tracer.instant("first token", self.request_id)
            choice = choices[out.index]
            for delta in choice.add(out, inp.grammar_trigger, self._marker):
                checked = self._checked(choice)
                for passed in gate.feed(delta, checked) if gate is not None and checked is not None else [delta]:
                    self._deltas.put(passed)
        if verdict is not None:  # the stream ended without an output (never, but for a bug)
            gate = self._gate(verdict.get())
        return gate

    async def _generate(
        self, inp: EngineInput, verdict: Outcome[CompiledConstraint | None] | None = None
    ) -> AsyncIterator[SeqOutput]:
        """The engine's outputs for ``inp``, from when ``verdict`` is in (the request prefills
        meanwhile); its sequences are aborted if the caller stops early.

        :raises EngineError: a sequence failed. :raises EngineFailed: the engine process was lost.
        :raises PipelineError: ``verdict``'s error (a refused constraint: the 400 naming its field).
        """
        # Admitted and prepared, the request is not refused now: it waits (outside any loop turn) while
        # the engine is behind on reading its commands; admission counts the waiters (Admission.admit).
        await self._engine.wait_room()
        # read the clock before the add leaves: an engine process may start its prefill before submit returns
        submitted = time.perf_counter()
        stream = self._engine.submit(inp)  # no await since the wait: the room is still there
        tokens = 0
        try:
            if verdict is not None:
                await verdict.wait()
                verdict.get()  # a refusal ends the request here; the engine fails its unsampled sequences
            async for out in stream:
                if out.error is not None:
                    raise self._engine_error(out)
                tokens += len(out.token_ids)
                self._metrics.tokens_generated += len(out.token_ids)
                yield out
        finally:
            if self._tracer is not None:
                self._tracer.span("decode", "engine", self.request_id, submitted, time.perf_counter(), tokens=tokens)
            if not stream.is_finished:
                self._engine.abort(inp.request_id)  # frees its KV slot and matcher at the next step

    def _engine_error(self, out: SeqOutput) -> PipelineError:
        """A failed sequence's error: the client's 400 when the grammar engine gave up on its
        constraint (a limit it reached), naming the constraint's field; else the engine's 500."""
        if out.error_kind == "constraint":
            spec = self.request.grammar
            field = spec.field if spec is not None else None
            return GrammarError(out.error or "", field=field, stage="engine", request_id=self.request_id)
        return EngineError(out.error or "", stage="engine", request_id=self.request_id)

    async def _resample(self, inp: EngineInput, gate: AnswerGate) -> None:
        """Sample each failed choice again (non-streaming only) until it passes or the attempts run out.

        :raises InvalidAnswer: a choice whose every attempt failed, naming where the last one broke.
        """
        for index, error in sorted(gate.failed.items()):
            for attempt in range(1, self._resample_attempts + 1):
                retry = dataclasses.replace(
                    inp,
                    request_id=f"{self.request_id}:resample{attempt}:{index}",
                    sampling=resample_params(inp.sampling, index=index, attempt=attempt),
                )
                choice = self._new_choice(index)
                async for out in self._generate(retry):
                    choice.add(out, retry.grammar_trigger, self._marker)
                self._metrics.answer_resamples += 1
                self._num_resamples += 1
                checked = self._checked(choice)
                failed = gate.verify(checked) if choice.finish_reason == "stop" and checked is not None else None
                if failed is None:
                    self._choices[index] = choice
                    if choice.reasoning:
                        self._deltas.put(Delta(index, choice.reasoning, [], is_reasoning=True))
                    is_call = choice.call_text is not None
                    text = choice.call_text if choice.call_text is not None else choice.text
                    delta = Delta(index, text, choice.token_ids, choice.finish_reason, choice.logprobs, is_call)
                    self._deltas.put(delta)
                    break
                error = failed
            else:
                error.message += f" (first answer and {self._resample_attempts} resamples)"
                raise error

    def cancel(self, error: PipelineError | None = None) -> None:
        """End the request; what it holds in the stages and the engine is released. It ends with
        ``error`` when given (a shutdown says so), else with ``RequestCancelled``."""
        if error is not None and self._error is None and not self.is_done:
            self._error = error.bind(request_id=self.request_id)
        self._scope.cancel()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delta]:
        try:
            async for delta in self._deltas:
                yield delta
        except PipelineError:
            raise
        except BaseException:
            self.cancel()  # the consumer went away (cancelled or broke out): stop generating
            raise

    async def wait_done(self) -> None:
        await self._outcome.wait()

    @property
    def is_done(self) -> bool:
        return self._outcome.is_done

    async def result(self) -> Result:
        """The finished result. :raises PipelineError: the request's typed error."""
        try:
            return await self._outcome.result()
        except PipelineError:
            raise
        except BaseException:
            self.cancel()
            raise
