"""RemoteGrammarStage: the serving process's grammar stage when the engine runs in its own process.

The engine process compiles (``pipeline.engine.grammars``): it matches the grammars, and a compiled
grammar costs 3-20x its compile to send. At admission a new spec (its size checked) crosses as a hint,
so the engine's compile overlaps the request's preparation; meanwhile the refusals every compile makes
first (``stages.grammar.checks.precheck``: limits, schemas without values, unsupported keywords) run
here, and the answer check (``stages.grammar.checks.CheckBuilder``) is built. ``compile`` returns with
a precheck's refusal at once, else once the engine's verdict is in: a spec the engine refused is the
same typed 400, naming its field, as in thread mode, before any decode work. Verdicts and checks are
cached here by spec (bounded like the engine's cache); the engine says unasked when xgrammar's grammar
has replaced a stand-in (until then each hit of one asks: the first such ask, the spec's second use,
starts xgrammar's compile there).

It answers the calls the pipeline makes of a ``GrammarStage`` (``compile``, ``wait_idle``, counters,
limiters); ``stats.backends`` and the compile counters are the engine's, as of its last verdict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup

from pipeline import errors
from pipeline.config import PipelineConfig
from pipeline.engine.client import ProcessEngine
from pipeline.engine.wire import GrammarVerdict
from pipeline.errors import GrammarError, PipelineError
from pipeline.outcome import Outcome
from pipeline.stage_factory import grammar_limits, llguidance_backend
from pipeline.types import GrammarSpec
from stages.grammar.answer_check import AnswerCheck
from stages.grammar.cache import GrammarCache
from stages.grammar.checks import CheckBuilder, precheck
from stages.grammar.limits import GrammarLimits, check_size
from stages.grammar.types import CompiledConstraint, GrammarStats, cache_counters, cached_entry, counted_hit, unwrap
from vision.checkpoint import Checkpoint

__all__ = ["RemoteGrammarStage", "build_remote_grammar_stage"]

_CHECK_BYTES = 16 * 1024  # a cached check's nominal size (a validator; the spec's key is counted too)
# A JSON schema this small is prechecked and its check built on the loop: under a millisecond (the
# corpus's 136 such schemas: max 0.88 ms here, the bench's 0.16 ms), where the hop to a worker thread
# and back (its wake-up, anyio's bookkeeping: about 0.4 ms of the loop's time per request in a py-spy
# profile) cost more than the work, beside the request's template step
_CHECK_INLINE_CHARS = 2048
_CHECK_INLINE_KINDS = frozenset({"json_schema", "json_object"})


@dataclass(frozen=True, slots=True)
class _Refused:
    error: GrammarError


def _error(verdict: GrammarVerdict) -> PipelineError:
    assert verdict.error is not None
    name, message, field, keywords = verdict.error
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, PipelineError)):
        return PipelineError(message, field=field)
    if cls is errors.UnsupportedSchemaError:
        return errors.UnsupportedSchemaError(message, keywords=keywords, field=field)
    return cls(message, field=field)


class RemoteGrammarStage:
    name = "grammar"

    def __init__(
        self,
        engine: ProcessEngine,
        checks: CheckBuilder,
        *,
        cache_bytes: int,
        max_concurrent: int,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.engine = engine
        self.checks = checks
        self.limits = limits if limits is not None else GrammarLimits()
        # prechecks and check builds (milliseconds); "grammar" and "grammar_fast" name the same limiter
        self.limiter = self.fast_limiter = anyio.CapacityLimiter(max_concurrent)
        self.stats = GrammarStats()
        self._counters: dict[str, float] = {}
        self._cache: GrammarCache[CompiledConstraint] = GrammarCache(cache_bytes)
        self._waiting = 0  # compiles whose verdict is awaited
        self._idle: anyio.Event | None = None  # set when _waiting returns to 0
        engine.on_unasked = self._replaced

    def attach(self, tg: TaskGroup) -> None:
        """Nothing runs in the pipeline's task group here (the engine process compiles)."""

    @property
    def num_compiling(self) -> int:
        """Specs whose engine verdict is awaited."""
        return self._waiting

    def lookup(self, spec: GrammarSpec) -> CompiledConstraint | PipelineError | None:
        """The cached verdict (or refusal) of ``spec``, without asking the engine."""
        return cached_entry(self._cache, spec.key)

    def counters(self) -> dict[str, float]:
        """Compile errors, timeouts, seconds (the engine's), and verdicts awaited here (for metrics)."""
        return {
            "errors": self.stats.errors + self._counters.get("errors", 0),
            "timeouts": self._counters.get("timeouts", 0),
            "compiling": self._waiting,
            "compile_seconds": self._counters.get("compile_seconds", 0.0),
        }

    def cache_counters(self) -> dict[str, float]:
        """This process's cache of verdicts and checks (for metrics)."""
        return cache_counters(self.stats, self._cache)

    async def wait_idle(self) -> None:
        """Return once no compile runs, here or in the engine process."""
        while self._waiting:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()
        if self.engine.status == "ok":
            _, reply = self.engine.ask("grammars_idle")
            await reply.wait()

    async def compile(self, spec: GrammarSpec, *, request_id: str | None = None) -> CompiledConstraint:
        """The engine's verdict on ``spec`` and the check of its answers (the engine's stage serves a
        new spec with llguidance while xgrammar compiles).

        :raises GrammarError: (400) the spec is refused or cannot be compiled by either backend.
        :raises DeadlineExceeded: (504) no backend compiled it within the configured deadline.
        :raises EngineFailed: (503) the engine process is starting again after a failure.
        """
        key = spec.key
        cached = counted_hit(self.stats, self._cache, key)
        if cached is not None:
            if isinstance(cached, CompiledConstraint) and cached.is_stand_in:
                cached = await self._ask(spec, cached.check)  # replaced there by now?
            return unwrap(cached, self.name, request_id)
        self._waiting += 1
        try:
            result = await self._first_compile(spec, request_id)
        finally:
            self._waiting -= 1
            if not self._waiting and self._idle is not None:
                self._idle.set()
                self._idle = None
        return unwrap(result, self.name, request_id)

    async def _first_compile(self, spec: GrammarSpec, request_id: str | None) -> CompiledConstraint | PipelineError:
        try:
            check_size(spec, spec.key, self.limits)  # before the spec crosses: the cache key holds it
        except GrammarError as exc:
            return self._refused(spec, exc)
        # the engine compiles while the checks run here: what precheck refuses, the engine's compile
        # refuses first too, with the same error (the verdict is then not waited for)
        token, reply = self.engine.ask("grammar", spec)
        try:
            if spec.kind in _CHECK_INLINE_KINDS and len(spec.key) <= _CHECK_INLINE_CHARS:
                checked = self._check(spec)
            else:
                checked = await anyio.to_thread.run_sync(self._check, spec, limiter=self.limiter)
        except BaseException:
            self.engine.forget(token)
            raise
        if isinstance(checked, _Refused):
            self.engine.forget(token)
            return self._refused(spec, checked.error)
        return await self._verdict(spec, token, reply, checked)

    def _check(self, spec: GrammarSpec) -> AnswerCheck | GrammarError | _Refused:
        """The answer check of ``spec`` (or why it cannot be built), or ``precheck``'s refusal."""
        try:
            precheck(spec, self.limits)
        except GrammarError as exc:
            return _Refused(exc)
        try:
            return self.checks.build(spec)
        except GrammarError as exc:
            return exc

    def _refused(self, spec: GrammarSpec, error: GrammarError) -> GrammarError:
        self.stats.errors += 1
        self._cache.store(spec.key, error)
        return error

    async def _ask(self, spec: GrammarSpec, check: AnswerCheck) -> CompiledConstraint | PipelineError:
        token, reply = self.engine.ask("grammar", spec)
        return await self._verdict(spec, token, reply, check)

    async def _verdict(
        self, spec: GrammarSpec, token: int, reply: Outcome[Any], check: AnswerCheck | GrammarError
    ) -> CompiledConstraint | PipelineError:
        """Wait for the engine's answer to ``token`` (forgotten if the caller leaves) and settle it."""
        try:
            await reply.wait()
        except BaseException:
            self.engine.forget(token)
            raise
        return self._settle(spec, reply.get(), check)

    def _replaced(self, verdict: GrammarVerdict) -> None:
        """The engine's xgrammar grammar has replaced the stand-in of the spec keyed ``verdict.key``:
        later hits need not ask it again."""
        self._figures(verdict)
        entry = self._cache.get(verdict.key)
        if isinstance(entry, CompiledConstraint) and entry.is_stand_in and verdict.error is None:
            fresh = dataclasses.replace(entry, backend=verdict.backend, reason=verdict.reason, is_stand_in=False)
            self._cache.store(verdict.key, fresh)

    def _figures(self, verdict: GrammarVerdict) -> None:
        self.stats.backends.clear()
        self.stats.backends.update(verdict.compiles)
        self._counters = verdict.counters

    def _settle(
        self, spec: GrammarSpec, verdict: GrammarVerdict, check: AnswerCheck | GrammarError
    ) -> CompiledConstraint | PipelineError:
        """Cache and return the verdict: the engine's refusal first (the compile refuses before a check
        is built), then the check's."""
        self._figures(verdict)
        result: CompiledConstraint | PipelineError
        if verdict.error is not None:
            result = _error(verdict)  # counted there
        elif isinstance(check, GrammarError):
            result = check
            self.stats.errors += 1
        else:
            nbytes = _CHECK_BYTES + len(spec.key)
            result = CompiledConstraint(
                spec.kind, verdict.backend, verdict.reason, None, check, nbytes, verdict.is_stand_in
            )
        if not (isinstance(result, errors.DeadlineExceeded) or _is_internal(result)):
            self._cache.store(spec.key, result)  # a timeout or a fault of the engine may not recur
        return result


def _is_internal(result: CompiledConstraint | PipelineError) -> bool:
    return type(result) is PipelineError


def build_remote_grammar_stage(
    config: PipelineConfig, checkpoint: Checkpoint, engine: ProcessEngine
) -> RemoteGrammarStage:
    """The grammar stage of a serving process whose engine (``engine``) compiles."""
    checks = CheckBuilder(any_whitespace=config.json_any_whitespace, llguidance=lambda: llguidance_backend(checkpoint))
    return RemoteGrammarStage(
        engine,
        checks,
        cache_bytes=config.grammar_cache_bytes,
        max_concurrent=config.grammar_max_concurrent_compiles,
        limits=grammar_limits(config),
    )
