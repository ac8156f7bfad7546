"""Grammar compile: xgrammar, started at admission, cached, single-flight, bounded and with a deadline.

- One ``GrammarCompiler`` per tokenizer; compiles run in worker threads (xgrammar releases the GIL),
  at most ``grammar_max_concurrent_compiles`` at once, so a slow schema cannot starve the rest.
- A bounded LRU cache keyed by the canonical spec; a hit costs a dict lookup, no thread hop.
  Failures are cached too: the same bad schema fails the same way, and the second time for free.
- Concurrent identical compiles share one job. The job belongs to the stage's task group, not to
  the first caller, so that caller's cancellation does not cancel it for the others.
- A waiter gives up after ``grammar_compile_timeout_s`` with a 504. The thread cannot be interrupted:
  it finishes in the background, holding its limiter token (a storm of slow schemas stays bounded),
  and its result is cached for the next request.
"""

from __future__ import annotations

import copy
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import anyio
import xgrammar as xgr
from anyio.abc import TaskGroup

from pipeline.types import DeadlineExceeded, GrammarError, GrammarSpec, Outcome, PipelineError
from stages.schema_support import check_schema_support

__all__ = ["GrammarStage", "GrammarStats", "compile_spec"]


@dataclass
class GrammarStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    compile_seconds: float = 0.0


def compile_spec(compiler: xgr.GrammarCompiler, spec: GrammarSpec, *, any_whitespace: bool) -> xgr.CompiledGrammar:
    """Compile one spec (synchronous, seconds for a hard schema).

    :raises GrammarError: naming ``spec.field`` when the spec is refused or xgrammar fails.
    """
    try:
        if spec.kind == "json_schema" and spec.value is not True:
            if not isinstance(spec.value, dict):
                raise GrammarError("the schema must be a JSON object", field=spec.field)
            check_schema_support(spec.value, strict=spec.strict, field=spec.field)
            return compiler.compile_json_schema(
                json.dumps(spec.value), any_whitespace=any_whitespace, strict_mode=spec.strict
            )
        if spec.kind in ("json_object", "json_schema"):
            schema = '{"type": "object"}' if spec.kind == "json_object" else "{}"
            return compiler.compile_json_schema(schema, any_whitespace=any_whitespace, strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value, root_rule_name="root")
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.value)
            return compiler.compile_grammar(f"root ::= {alternatives}")
    except PipelineError:
        raise
    except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError with a message
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise GrammarError(f"could not compile the {spec.kind}: {message}", field=spec.field) from None
    raise GrammarError(f"unknown constraint kind {spec.kind!r}", field=spec.field)


class GrammarStage:
    name = "grammar"

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        any_whitespace: bool = False,
        timeout_s: float = 30.0,
        cache_size: int = 512,
        max_concurrent: int = 2,
    ) -> None:
        # xgrammar's own cache is off: ours is bounded, keyed by the canonical spec, and caches errors
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=False)
        self.any_whitespace = any_whitespace
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.limiter = anyio.CapacityLimiter(max_concurrent)
        self.stats = GrammarStats()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._flights: dict[str, Outcome[Any]] = {}  # one compile job per key; its waiters
        self._tg: TaskGroup | None = None

    def attach(self, tg: TaskGroup) -> None:
        """Run compile jobs in ``tg`` (the pipeline's); without one, the first caller runs the job shielded."""
        self._tg = tg

    def _compile_sync(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return compile_spec(self.compiler, spec, any_whitespace=self.any_whitespace)

    async def _job(self, key: str, spec: GrammarSpec, flight: Outcome[Any]) -> None:
        started = time.perf_counter()
        result: Any = None
        try:
            result = await anyio.to_thread.run_sync(self._compile_sync, spec, limiter=self.limiter)
        except PipelineError as exc:
            result = exc
            self.stats.errors += 1
        finally:
            self.stats.compile_seconds += time.perf_counter() - started
            if result is not None:
                self._cache[key] = result
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            del self._flights[key]
            # errors are values here: each waiter raises its own copy (see _unwrap)
            if result is not None:
                flight.set_result(result)
            else:  # cancelled with the pipeline: its waiters are going away too
                flight.fail(GrammarError("the compile was cancelled"))

    def _unwrap(self, result: Any, request_id: str | None) -> xgr.CompiledGrammar:
        if isinstance(result, PipelineError):
            error = copy.copy(result)  # one error object per request: each carries its own request id
            error.stage, error.request_id = self.name, request_id
            raise error
        return result

    @property
    def num_compiling(self) -> int:
        """Compile jobs in flight (each holds or waits for a limiter token)."""
        return len(self._flights)

    async def wait_idle(self) -> None:
        """Return once no compile job is running (their threads have returned)."""
        while self._flights:
            await next(iter(self._flights.values())).wait()

    def lookup(self, spec: GrammarSpec) -> Any | None:
        """The cached compiled grammar (or cached error) of ``spec``, without compiling."""
        return self._cache.get(spec.key)

    async def compile(self, spec: GrammarSpec, *, request_id: str | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``.

        :raises GrammarError: (400) the spec is refused or cannot be compiled.
        :raises DeadlineExceeded: (504) the compile took longer than the configured deadline.
        """
        key = spec.key
        if key in self._cache:
            self.stats.hits += 1
            self._cache.move_to_end(key)
            return self._unwrap(self._cache[key], request_id)
        self.stats.misses += 1
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = Outcome()
            if self._tg is not None:
                self._tg.start_soon(self._job, key, spec, flight)
            else:
                with anyio.CancelScope(shield=True):
                    await self._job(key, spec, flight)
        with anyio.move_on_after(self.timeout_s) as scope:
            await flight.wait()
        if scope.cancelled_caught:
            self.stats.timeouts += 1
            raise DeadlineExceeded(
                f"the {spec.kind} did not compile within {self.timeout_s:g} s",
                field=spec.field,
                stage=self.name,
                request_id=request_id,
            )
        try:
            result = flight.get()
        except GrammarError as exc:
            result = exc
        return self._unwrap(result, request_id)
