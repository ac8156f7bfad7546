"""The engine process's grammars: compiled there from the spec the serving process validated, cached.

The serving process compiles every spec too (its answer check, and the 400 for a bad spec before any
decode work), so what arrives here compiles; a compiled grammar is not sent because serializing one
costs 3-20x its compile. Compiles run on threads (both backends release the GIL), one job per spec
however many requests wait for it; the cache is bounded by the compilers' own size estimates.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.types import GrammarSpec
from sampling.llguidance_backend import LLGuidanceBackend
from stages.grammar_backends import Compiled, LLGuidanceCompiler, XGrammarCompiler
from stages.native_calls import run_on_large_stack
from vision.checkpoint import Checkpoint

__all__ = ["EngineGrammars"]


class EngineGrammars:
    """Compiled grammars by (backend, spec key); ``on_done`` is called (on a compile thread) as each ends."""

    def __init__(self, config: PipelineConfig, checkpoint: Checkpoint, on_done: Callable[[], None]) -> None:
        self._config = config
        self._checkpoint = checkpoint
        self._on_done = on_done
        self._compilers: dict[str, Any] = {}
        self._compilers_lock = threading.Lock()  # built on first use, on a compile thread
        self._executor = ThreadPoolExecutor(config.grammar_max_concurrent_compiles, thread_name_prefix="compile")
        self._cache: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self._cache_bytes = 0
        self._flights: dict[tuple[str, str], Future[Compiled]] = {}

    def get(self, backend: str, spec: GrammarSpec) -> Any | Future[Compiled]:
        """The compiled grammar, or the future of its compile (the caller waits for ``on_done``)."""
        key = (backend, spec.key)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached.grammar
        flight = self._start(key, spec)
        fast = self._cache.get(("llguidance", spec.key)) if backend == "xgrammar" else None
        if fast is not None:
            # the serving process once served this spec with llguidance while its xgrammar compile
            # ran (over the budget: seconds): here too, until ours has finished
            return fast.grammar
        return flight

    def _start(self, key: tuple[str, str], spec: GrammarSpec) -> Future[Compiled]:
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = self._executor.submit(self._compile, key[0], spec)
            flight.add_done_callback(lambda _: self._on_done())
        return flight

    def collect(self) -> None:
        """Cache the compiles that have finished (failed ones are dropped: their waiters hold them)."""
        for key, flight in list(self._flights.items()):
            if flight.done():
                del self._flights[key]
                if not flight.cancelled() and flight.exception() is None:
                    self._keep(key, flight.result())

    def _keep(self, key: tuple[str, str], compiled: Compiled) -> None:
        self._cache[key] = compiled
        self._cache_bytes += compiled.nbytes
        while self._cache_bytes > self._config.grammar_cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.nbytes

    def _compile(self, backend: str, spec: GrammarSpec) -> Compiled:
        compiler = self._compiler(backend)
        return run_on_large_stack(lambda: compiler.compile(spec))

    def _compiler(self, backend: str) -> Any:
        with self._compilers_lock:
            if backend not in self._compilers:
                info = self._checkpoint.tokenizer_info
                if backend == "xgrammar":
                    self._compilers[backend] = XGrammarCompiler(info, any_whitespace=self._config.json_any_whitespace)
                else:
                    stop_ids = [int(t) for t in info.stop_token_ids]
                    llguidance = LLGuidanceBackend(
                        self._checkpoint.tokenizer, vocab_size=info.vocab_size, stop_token_ids=stop_ids
                    )
                    self._compilers[backend] = LLGuidanceCompiler(llguidance)
            return self._compilers[backend]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
