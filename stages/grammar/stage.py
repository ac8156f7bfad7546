"""Grammar compile: per request xgrammar or llguidance, started at admission, cached, single-flight,
bounded, and unable to starve the server.

- Which backend serves a spec, and when llguidance stands in for xgrammar:
  ``stages.grammar.backend_choice``; the compile jobs, single-flight and each backend under its
  own limiter: ``stages.grammar.jobs``; a compile in its worker thread: ``stages.grammar.compile``.
- The cache (``stages.grammar.cache``) is keyed by the canonical spec, bounded by bytes
  (``cache_bytes``: xgrammar reports a grammar's size, llguidance's is estimated). Errors are cached
  too (small): the same bad schema fails the same way, free.
- A waiter gives up after ``timeout_s`` with a 504.
- What reaches a compiler is bounded (``stages.grammar.limits``): the size on the loop (the cache
  key holds it), the rest in the compile thread.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskGroup

from pipeline.errors import DeadlineExceeded, GrammarError, PipelineError
from pipeline.outcome import Outcome
from pipeline.types import GrammarSpec
from stages.grammar.backend_choice import BackendChoice
from stages.grammar.backends import LLGuidanceCompiler, XGrammarCompiler
from stages.grammar.cache import GrammarCache
from stages.grammar.limits import GrammarLimits, check_size
from stages.grammar.types import CompiledConstraint, GrammarStats, cache_counters, cached_entry, counted_hit, unwrap

__all__ = ["CompiledConstraint", "GrammarStage", "GrammarStats"]


class GrammarStage(BackendChoice):
    name = "grammar"

    def __init__(
        self,
        xgrammar: XGrammarCompiler,
        llguidance: LLGuidanceCompiler,
        *,
        timeout_s: float = 30.0,
        cache_bytes: int = 512 * 1024 * 1024,
        max_concurrent: int = 2,
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
        return cached_entry(self._cache, spec.key)

    def mark_used(self, spec: GrammarSpec) -> None:
        """Count ``spec``'s cached entry as just used (a use that did not go through ``compile``)."""
        self._cache.hit(spec.key)

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
        return cache_counters(self.stats, self._cache)

    async def compile(self, spec: GrammarSpec, *, request_id: str | None = None) -> CompiledConstraint:
        """The compiled constraint of ``spec``; the caller waits for no xgrammar compile that llguidance
        can stand in for (a hit of a stand-in starts one in the background).

        :raises GrammarError: (400) the spec is refused or cannot be compiled by either backend.
        :raises DeadlineExceeded: (504) no backend compiled it within the configured deadline.
        """
        key = spec.key
        cached = counted_hit(self.stats, self._cache, key)
        if cached is not None:
            if isinstance(cached, CompiledConstraint) and cached.is_stand_in:
                self._replace_stand_in(spec)
            return unwrap(cached, self.name, request_id)
        try:
            check_size(spec, key, self.limits)  # before the loop walks the spec to choose a backend
        except GrammarError as exc:
            self.stats.errors += 1
            raise exc.bind(stage=self.name, request_id=request_id) from None
        with anyio.move_on_after(self.timeout_s) as scope:
            flight = await self._resolve(spec)
        if scope.cancelled_caught:
            self.stats.timeouts += 1
            raise DeadlineExceeded(
                f"the {spec.kind} did not compile within {self.timeout_s:g} s",
                field=spec.field,
                stage=self.name,
                request_id=request_id,
            )
        error = flight.error
        return unwrap(error if isinstance(error, PipelineError) else flight.get(), self.name, request_id)
