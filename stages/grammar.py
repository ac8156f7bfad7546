"""Grammar compile: per request xgrammar or llguidance, started at admission, cached, single-flight,
bounded, and unable to starve the server.

- The backend comes from the spec's features (``stages.grammar_dispatch``). A spec meant for
  xgrammar is served by llguidance instead (a stand-in) when both xgrammar compile slots are taken,
  when its xgrammar compile has not finished within ``xgrammar_budget_s``, or when the request needs
  its constraint before that (``needed``: a text-only request, cached images, preparation done):
  llguidance compiles in milliseconds, so cheap specs and refusals answer at once while a big schema
  compiles, and a short preparation does not wait for a compile it cannot hide. The xgrammar compile
  goes on in the background (a thread cannot be interrupted), holding its slot, and its result
  replaces the stand-in in the cache; a stand-in served while the slots were busy is replaced the
  same way by the first cache hit that finds a slot free.
- An EBNF or Lark grammar or a structural tag is parsed first, without a compile slot: a malformed
  one is a 400 at once, never a wait behind busy slots; what llguidance cannot compile of these
  (xgrammar's look-ahead, structural-tag formats Lark cannot say) waits for xgrammar.
- Compiles run in worker threads (both libraries release the GIL), each backend under its own limiter.
- The cache (``stages.grammar_cache``) is keyed by the canonical spec, bounded by bytes
  (``cache_bytes``: xgrammar reports a grammar's size, llguidance's is estimated). Errors are cached
  too (small): the same bad schema fails the same way, free.
- Concurrent identical compiles share one job. Jobs belong to the stage's task group, not to the
  first caller, so that caller's cancellation does not cancel the job for the others.
- A waiter gives up after ``timeout_s`` with a 504.
- What reaches a compiler is bounded (``stages.grammar_limits``): the size on the loop (the cache
  key holds it), the rest in the compile thread. Each compile runs on a thread with a large stack
  and a large one trims the heap after it (``stages.native_calls``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from pipeline.errors import DeadlineExceeded, GrammarError, PipelineError, UnsupportedSchemaError
from pipeline.outcome import Outcome, first_of
from pipeline.types import GrammarSpec
from sampling.llguidance_matcher import INTERNAL_FAILURE
from stages.answer_check import AnswerCheck
from stages.grammar_backends import Compiled, LLGuidanceCompiler, XGrammarCompiler
from stages.grammar_cache import GrammarCache
from stages.grammar_dispatch import LLGUIDANCE_KINDS, PARSED_KINDS, choose_backend, is_lark
from stages.grammar_limits import GrammarLimits, check_limits, check_size
from stages.native_calls import release_free_memory, run_on_large_stack

__all__ = ["CompiledConstraint", "GrammarStage", "GrammarStats"]

# After a compile this long, or of a spec this large, the heap is trimmed: its peak (a 20,000-rule
# grammar: over 1 GB) would otherwise stay with the process
_TRIM_AFTER_S = 0.5
_TRIM_AFTER_CHARS = 64 * 1024
_BACKGROUND_NICE = 19
# why llguidance served a spec meant for xgrammar: its grammar is replaced once xgrammar compiled it
_SLOTS_BUSY = "xgrammar compile slots busy"
_STAND_IN_REASONS = frozenset({_SLOTS_BUSY, "xgrammar compile over budget", "xgrammar compile outlasts preparation"})


@dataclass
class GrammarStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    compile_seconds: float = 0.0
    backends: Counter[str] = field(default_factory=Counter)  # compiles by "backend: reason"


@dataclass(frozen=True, slots=True, eq=False)
class CompiledConstraint:
    """A request's compiled constraint: what the engine makes matchers from, and the check every
    finished answer must pass."""

    kind: str
    backend: str  # "xgrammar" | "llguidance"
    reason: str  # why that backend (a dispatch row, "default", "xgrammar busy", ...)
    grammar: Any  # xgr.CompiledGrammar | LLGrammar
    check: AnswerCheck
    nbytes: int
    is_stand_in: bool = False  # llguidance's, until xgrammar's compile of the same spec replaces it


class GrammarStage:
    name = "grammar"

    def __init__(
        self,
        xgrammar: XGrammarCompiler,
        llguidance: LLGuidanceCompiler,
        *,
        timeout_s: float = 30.0,
        cache_bytes: int = 512 * 1024 * 1024,
        max_concurrent: int = 2,
        xgrammar_budget_s: float = 0.5,
        backend: str = "auto",
        abandon_on_shutdown: bool = False,
        limits: GrammarLimits | None = None,
    ) -> None:
        if backend not in ("auto", "xgrammar", "llguidance"):
            raise ValueError(f"backend must be auto, xgrammar or llguidance, got {backend!r}")
        self.backend = backend  # "auto": per request by the dispatch table; else forced (benchmarks, operators)
        self._parser = xgrammar
        self.compilers: dict[str, XGrammarCompiler | LLGuidanceCompiler] = {
            "xgrammar": xgrammar,
            "llguidance": llguidance,
        }
        self.timeout_s = timeout_s
        self.limits = limits if limits is not None else GrammarLimits()
        self.xgrammar_budget_s = xgrammar_budget_s
        self.limiter = anyio.CapacityLimiter(max_concurrent)  # xgrammar compiles: seconds each
        self.fast_limiter = anyio.CapacityLimiter(max_concurrent)  # llguidance compiles: milliseconds
        self.stats = GrammarStats()
        self._cache: GrammarCache[CompiledConstraint] = GrammarCache(cache_bytes)
        self._flights: dict[tuple[str, str], Outcome[CompiledConstraint]] = {}  # (backend, key) -> job
        self._tg: TaskGroup | None = None
        # False: a shutdown waits for the compile threads (nothing keeps running after the stage);
        # True: it leaves them running (a server that must exit within its shutdown timeout)
        self.abandon_on_shutdown = abandon_on_shutdown

    def attach(self, tg: TaskGroup) -> None:
        """Run compile jobs in ``tg`` (the pipeline's); without one, the first caller runs the job shielded."""
        self._tg = tg

    # -- the cache ------------------------------------------------------------------------------
    @property
    def cached_bytes(self) -> int:
        return self._cache.num_bytes

    @property
    def cache_bytes(self) -> int:
        return self._cache.max_bytes

    def lookup(self, spec: GrammarSpec) -> CompiledConstraint | PipelineError | None:
        """The cached constraint (or cached error) of ``spec``, without compiling."""
        entry = self._cache.get(spec.key)
        assert entry is None or isinstance(entry, CompiledConstraint | PipelineError)
        return entry

    def counters(self) -> dict[str, float]:
        """Compile errors, timeouts, jobs in flight and seconds spent (for metrics)."""
        stats = self.stats
        return {
            "errors": stats.errors,
            "timeouts": stats.timeouts,
            "compiling": self.num_compiling,
            "compile_seconds": stats.compile_seconds,
        }

    def cache_counters(self) -> dict[str, float]:
        """The cache's hits, misses, bytes and entries (for metrics)."""
        return {
            "hits": self.stats.hits,
            "misses": self.stats.misses,
            "evictions": self._cache.evictions,
            "bytes": self._cache.num_bytes,
            "bytes_bound": self._cache.max_bytes,
            "entries": len(self._cache),
        }

    # -- compile jobs -----------------------------------------------------------------------------
    @property
    def num_compiling(self) -> int:
        """Compile jobs in flight (each holds or waits for a limiter token)."""
        return len(self._flights)

    async def wait_idle(self) -> None:
        """Return once no compile job is running (their threads have returned)."""
        while self._flights:
            await next(iter(self._flights.values())).wait()

    async def wait_replaced(self, spec: GrammarSpec) -> None:
        """Return once no xgrammar compile of ``spec`` runs (one that replaces a stand-in has ended)."""
        flight = self._flights.get(("xgrammar", spec.key))
        if flight is not None:
            await flight.wait()

    def _compile_sync(self, backend: str, spec: GrammarSpec, nice: int) -> Compiled:
        check_limits(spec, self.limits)
        started = time.perf_counter()
        try:
            return run_on_large_stack(lambda: self.compilers[backend].compile(spec), nice=nice)
        except BaseException as exc:
            # a Rust panic that llguidance's bindings let through is pyo3's PanicException, a
            # BaseException: it fails this spec, not the stage's task group
            if type(exc).__name__ != "PanicException":
                raise
            raise GrammarError(f"could not compile the {spec.kind}: {INTERNAL_FAILURE}", field=spec.field) from None
        finally:
            if time.perf_counter() - started > _TRIM_AFTER_S or len(spec.key) > _TRIM_AFTER_CHARS:
                release_free_memory()

    def _parse_sync(self, spec: GrammarSpec) -> None:
        check_limits(spec, self.limits)  # a compile's bounds and stack: the parse reads the same text
        run_on_large_stack(lambda: self._parser.parse(spec))

    async def _job(
        self, backend: str, reason: str, spec: GrammarSpec, flight: Outcome[CompiledConstraint], nice: int
    ) -> None:
        started = time.perf_counter()
        limiter = self.limiter if backend == "xgrammar" else self.fast_limiter
        try:
            # Jobs are cancelled only when the pipeline shuts down (a waiter's cancellation never reaches
            # them): then nobody waits for the result, and a compile cannot be interrupted (xgrammar's
            # worst took 72 s here).
            compiled = await anyio.to_thread.run_sync(
                self._compile_sync, backend, spec, nice, limiter=limiter, abandon_on_cancel=self.abandon_on_shutdown
            )
            is_stand_in = backend == "llguidance" and reason in _STAND_IN_REASONS
            result: CompiledConstraint | PipelineError = CompiledConstraint(
                spec.kind, backend, reason, compiled.grammar, compiled.check, compiled.nbytes, is_stand_in
            )
            self.stats.backends[f"{backend}: {reason}"] += 1
        except PipelineError as exc:
            result = exc
            self.stats.errors += 1
        except BaseException:
            flight.fail(GrammarError(f"the {spec.kind} compile was cancelled", field=spec.field))
            raise
        finally:
            self.stats.compile_seconds += time.perf_counter() - started
            del self._flights[(backend, spec.key)]
        current = self._cache.get(spec.key)
        # a grammar replaces a cached error, a late xgrammar grammar its llguidance stand-in; an
        # error never replaces a grammar
        is_grammar = isinstance(result, CompiledConstraint)
        if current is None or (is_grammar and (isinstance(current, PipelineError) or backend == "xgrammar")):
            self._cache.store(spec.key, result)
        current = self._cache.get(spec.key)
        if backend == "xgrammar" and isinstance(current, CompiledConstraint) and current.is_stand_in:
            # xgrammar failed, or its grammar is too big to cache: the stand-in stays, and no hit retries
            self._cache.store(spec.key, dataclasses.replace(current, is_stand_in=False))
        if isinstance(result, CompiledConstraint):
            flight.set_result(result)
        else:
            flight.fail(result)

    def _flight(
        self, backend: str, reason: str, spec: GrammarSpec, nice: int = 0
    ) -> tuple[Outcome[CompiledConstraint], bool]:
        """The job compiling ``spec`` with ``backend`` (started now if none, ``nice`` added to its
        thread's niceness); True when it is new."""
        flight = self._flights.get((backend, spec.key))
        if flight is not None:
            return flight, False
        flight = self._flights[(backend, spec.key)] = Outcome()
        if self._tg is not None:
            self._tg.start_soon(self._job, backend, reason, spec, flight, nice)
        return flight, True

    async def _await(
        self,
        backend: str,
        reason: str,
        spec: GrammarSpec,
        *,
        budget_s: float | None = None,
        needed: anyio.Event | None = None,
        nice: int = 0,
    ) -> Outcome[CompiledConstraint]:
        """The job's outcome once it is done, or (with ``budget_s``, ``needed``) when the budget runs
        out or ``needed`` is set first."""
        flight, is_new = self._flight(backend, reason, spec, nice)
        if is_new and self._tg is None:  # no task group to leave the job in: run it here, shielded
            with anyio.CancelScope(shield=True):
                await self._job(backend, reason, spec, flight, nice)
        if needed is None:
            with anyio.move_on_after(budget_s if budget_s is not None else float("inf")):
                await flight.wait()
        elif not needed.is_set() and not flight.is_done:
            with anyio.move_on_after(budget_s if budget_s is not None else float("inf")):
                await first_of(flight.wait, needed.wait)
        return flight

    async def _resolve(self, spec: GrammarSpec, needed: anyio.Event | None) -> Outcome[CompiledConstraint]:
        if self.backend == "llguidance" and spec.kind in LLGUIDANCE_KINDS:
            return await self._await("llguidance", "forced by config", spec)
        if self.backend != "auto":
            return await self._await("xgrammar", "forced by config", spec)
        dispatch = choose_backend(spec)
        if dispatch.backend == "llguidance":
            flight = await self._await("llguidance", dispatch.reason, spec)
            if not isinstance(flight.error, UnsupportedSchemaError):
                return flight  # compiled, or refused for a reason xgrammar would not fix (unsatisfiable)
            # llguidance refuses some keywords outright (uniqueItems, dependencies) where xgrammar
            # ignores them: the answer check holds those, so xgrammar's looser grammar serves
            fallback = await self._await("xgrammar", "llguidance could not compile it", spec)
            return fallback if fallback.error is None else flight
        if spec.kind not in LLGUIDANCE_KINDS:
            return await self._await("xgrammar", dispatch.reason, spec)
        is_dialect = spec.kind in PARSED_KINDS  # llguidance compiles only part of xgrammar's dialects
        if is_dialect:
            refusal = await self._parse(spec)
            if refusal is not None and is_lark(spec.value):  # Lark xgrammar cannot read: llguidance's own
                return await self._await("llguidance", "Lark grammar", spec)
            if refusal is not None:
                failed: Outcome[CompiledConstraint] = Outcome()
                failed.fail(refusal)
                return failed
        if spec.field == "tools":
            # a tool call's grammar never gets a stand-in: the two backends lay out one greedy call
            # differently, so the same request would get another call once xgrammar's compile landed
            return await self._await("xgrammar", dispatch.reason, spec)
        if ("xgrammar", spec.key) not in self._flights and self._is_busy():
            return await self._stand_in(spec, _SLOTS_BUSY, None, is_dialect)
        # a compile nobody waits for (llguidance stands in at once) yields the CPU to the request's
        # own work: the lowest priority (its native threads run without the GIL)
        nice = _BACKGROUND_NICE if needed is not None and needed.is_set() and not is_dialect else 0
        budget_s = self.xgrammar_budget_s
        flight = await self._await("xgrammar", dispatch.reason, spec, budget_s=budget_s, needed=needed, nice=nice)
        if flight.is_done and flight.error is None:
            return flight
        if flight.is_done:
            reason = "xgrammar could not compile it"
        elif needed is not None and needed.is_set():
            reason = "xgrammar compile outlasts preparation"
        else:
            reason = "xgrammar compile over budget"
        return await self._stand_in(spec, reason, flight, is_dialect)

    def _is_busy(self) -> bool:
        return self.limiter.borrowed_tokens >= self.limiter.total_tokens

    async def _stand_in(
        self, spec: GrammarSpec, reason: str, xgrammar: Outcome[CompiledConstraint] | None, is_dialect: bool
    ) -> Outcome[CompiledConstraint]:
        """llguidance's compile of a spec meant for xgrammar; where llguidance fails, ``xgrammar``'s
        outcome (its job, started now if None) decides when llguidance's refusal may not be final."""
        # decided before llguidance answers, so which refusal a client gets never depends on which
        # compile ended first
        xgrammar_failed = xgrammar is not None and xgrammar.is_done
        fallback = await self._await("llguidance", reason, spec)
        if fallback.error is None:
            return fallback
        if xgrammar is not None and xgrammar_failed:
            return xgrammar  # both failed: the default backend's error is the one reported
        # what llguidance cannot translate, or refuses to enforce, xgrammar may still compile
        if is_dialect or isinstance(fallback.error, UnsupportedSchemaError):
            if xgrammar is None:
                return await self._await("xgrammar", "llguidance could not compile it", spec)
            await xgrammar.wait()
            return xgrammar
        return fallback

    async def _parse(self, spec: GrammarSpec) -> GrammarError | None:
        """xgrammar's parse of a grammar or structural tag (no compile slot: milliseconds); the
        error it is refused with, cached as a compile's would be, or None."""
        try:
            await anyio.to_thread.run_sync(self._parse_sync, spec, limiter=self.fast_limiter)
        except GrammarError as exc:
            self.stats.errors += 1
            self._cache.store(spec.key, exc)
            return exc
        return None

    async def compile(
        self, spec: GrammarSpec, *, request_id: str | None = None, needed: anyio.Event | None = None
    ) -> CompiledConstraint:
        """The compiled constraint of ``spec``; once ``needed`` is set the caller waits for no xgrammar
        compile that llguidance can stand in for (it goes on in the background).

        :raises GrammarError: (400) the spec is refused or cannot be compiled by either backend.
        :raises DeadlineExceeded: (504) no backend compiled it within the configured deadline.
        """
        key = spec.key
        cached = self._cache.hit(key)
        if cached is not None:
            self.stats.hits += 1
            assert isinstance(cached, CompiledConstraint | PipelineError)
            if isinstance(cached, CompiledConstraint) and cached.is_stand_in:
                self._replace_stand_in(spec)
            return self._unwrap(cached, request_id)
        self.stats.misses += 1
        try:
            check_size(spec, key, self.limits)  # before the loop walks the spec to choose a backend
        except GrammarError as exc:
            self.stats.errors += 1
            raise exc.bind(stage=self.name, request_id=request_id) from None
        with anyio.move_on_after(self.timeout_s) as scope:
            flight = await self._resolve(spec, needed)
        if scope.cancelled_caught:
            self.stats.timeouts += 1
            raise DeadlineExceeded(
                f"the {spec.kind} did not compile within {self.timeout_s:g} s",
                field=spec.field,
                stage=self.name,
                request_id=request_id,
            )
        error = flight.error
        return self._unwrap(error if isinstance(error, PipelineError) else flight.get(), request_id)

    def _replace_stand_in(self, spec: GrammarSpec) -> None:
        """Start xgrammar's compile of a spec llguidance stands in for, when a slot is free and none runs."""
        if self._tg is not None and ("xgrammar", spec.key) not in self._flights and not self._is_busy():
            self._flight("xgrammar", "replaces the llguidance stand-in", spec, _BACKGROUND_NICE)

    def _unwrap(self, result: CompiledConstraint | PipelineError, request_id: str | None) -> CompiledConstraint:
        if isinstance(result, PipelineError):
            error = copy.copy(result)  # one error object per request: each carries its own request id
            error.stage, error.request_id = self.name, request_id
            raise error
        return result
