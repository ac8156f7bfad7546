"""The grammar stage's compile jobs: one per backend and spec, run in a worker thread, their result cached.

- Compiles run on the process's compile threads (``stages.grammar.native_calls``), each backend under its own limiter.
- Concurrent identical compiles share one job. Jobs belong to the stage's task group, not to the
  first caller, so that caller's cancellation does not cancel the job for the others.
- A job's grammar replaces a cached error, and xgrammar's grammar the llguidance stand-in of the
  same spec; an error never replaces a grammar.
"""

from __future__ import annotations

import dataclasses
import time

import anyio
from anyio.abc import TaskGroup

from pipeline.errors import GrammarError, PipelineError
from pipeline.outcome import Outcome
from pipeline.types import GrammarSpec
from stages.grammar.backends import LLGuidanceCompiler, XGrammarCompiler
from stages.grammar.cache import GrammarCache
from stages.grammar.compile import compile_on_thread
from stages.grammar.limits import GrammarLimits
from stages.grammar.types import STAND_IN_REASONS, CompiledConstraint, GrammarStats

__all__ = ["GrammarJobs"]


class GrammarJobs:
    """The compile jobs of ``stages.grammar.GrammarStage``, which sets the attributes below."""

    compilers: dict[str, XGrammarCompiler | LLGuidanceCompiler]
    limits: GrammarLimits
    limiter: anyio.CapacityLimiter
    fast_limiter: anyio.CapacityLimiter
    stats: GrammarStats
    abandon_on_shutdown: bool
    _cache: GrammarCache[CompiledConstraint]
    _flights: dict[tuple[str, str], Outcome[CompiledConstraint]]
    _tg: TaskGroup | None

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

    async def _job(
        self, backend: str, reason: str, spec: GrammarSpec, flight: Outcome[CompiledConstraint], nice: int
    ) -> None:
        started = time.perf_counter()
        limiter = self.limiter if backend == "xgrammar" else self.fast_limiter
        try:
            # Jobs are cancelled only when the pipeline shuts down (a waiter's cancellation never reaches
            # them): then nobody waits for the result, and a compile cannot be interrupted (xgrammar's
            # worst took 72 s here).
            compiled = await compile_on_thread(
                self.compilers,
                backend,
                spec,
                self.limits,
                nice=nice,
                limiter=limiter,
                abandon_on_cancel=self.abandon_on_shutdown,
            )
            is_stand_in = backend == "llguidance" and reason in STAND_IN_REASONS
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
        self, backend: str, reason: str, spec: GrammarSpec, *, wait: bool = True, nice: int = 0
    ) -> Outcome[CompiledConstraint]:
        """The job's outcome once it is done, or (``wait=False``) at once, while it may still run."""
        flight, is_new = self._flight(backend, reason, spec, nice)
        if is_new and self._tg is None:  # no task group to leave the job in: run it here, shielded
            with anyio.CancelScope(shield=True):
                await self._job(backend, reason, spec, flight, nice)
        if wait:
            await flight.wait()
        return flight
