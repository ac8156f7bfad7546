"""The engine process's grammars: the one place a grammar is compiled in ``engine_mode="process"``.

The serving process sends a new spec at admission (``("grammar", token, spec)``): the engine process's
``GrammarStage`` compiles it (the backend policy, the llguidance stand-in, single flight, the compile
limits and the cache bounds are the stage's, as in thread mode) while the request's preparation runs,
and its verdict goes back (the backend, or the typed error for the serving process's 400). An add finds
its grammar in the same cache, or waits for its compile (the entry was evicted, or a new engine process
started since). A compiled grammar is not sent: serializing one costs 3-20x its compile.

The stage runs on an event loop of its own (a thread, ``anyio.from_thread``); its compiles on worker
threads (both backends release the GIL), so the decode loop only hands specs over and reads results.
It hands them over without waiting: a portal's ``start_task_soon`` returns only once the stage's loop
has run the spawn, a round trip through another thread's wake-up (and a free core) per guided add.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal, start_blocking_portal

from pipeline.config import PipelineConfig
from pipeline.engine.wire import GrammarsIdle, GrammarVerdict
from pipeline.errors import PipelineError, UnsupportedSchemaError
from pipeline.stage_factory import build_grammar_stage
from pipeline.types import GrammarSpec
from stages.grammar import CompiledConstraint, GrammarStage
from vision.checkpoint import Checkpoint

__all__ = ["EngineGrammars", "verdict_of"]

logger = logging.getLogger(__name__)


def verdict_of(token: int, outcome: CompiledConstraint | BaseException, stage: GrammarStage) -> GrammarVerdict:
    """The message that answers grammar command ``token`` with its compile's ``outcome``."""
    stats = stage.stats
    figures: dict[str, Any] = {"compiles": dict(stats.backends), "counters": stage.counters()}
    if isinstance(outcome, CompiledConstraint):
        return GrammarVerdict(token, outcome.backend, outcome.reason, outcome.is_stand_in, **figures)
    error = outcome
    if not isinstance(error, PipelineError):
        error = PipelineError(f"internal error ({type(error).__name__})")
    keywords = error.keywords if isinstance(error, UnsupportedSchemaError) else []
    return GrammarVerdict(token, error=(type(error).__name__, error.message, error.field, keywords), **figures)


class EngineGrammars:
    """A ``GrammarStage`` on its own event loop thread; ``send`` is called from that thread with each
    verdict, ``on_done`` when an add's compile has ended (the decode loop may be asleep in select)."""

    def __init__(
        self,
        config: PipelineConfig,
        checkpoint: Checkpoint,
        send: Callable[[Any], None],
        on_done: Callable[[], None],
    ) -> None:
        self.stage = build_grammar_stage(config, checkpoint)
        # the process exits when it stops: no compile thread must hold that up
        self.stage.abandon_on_shutdown = True
        self._send = send
        self._on_done = on_done
        self._exit = contextlib.ExitStack()
        self._portal: BlockingPortal = self._exit.enter_context(start_blocking_portal())
        self._stop: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the portal's (asyncio, anyio's default)
        self._tg: TaskGroup | None = None
        # calls the decode loop posts (appended on its thread, taken on the stage's: deque operations
        # are atomic), and the event that wakes their taker
        self._posts: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        self._posted: anyio.Event | None = None
        self._watched: set[str] = set()  # specs whose stand-in's replacement will be told
        # tokens asked and not yet answered: added on the decode loop's thread, discarded on the stage's
        # (set operations are atomic under the GIL)
        self._owed: set[int] = set()
        self._host, _ = self._portal.start_task(self._run)

    async def _run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self._stop = anyio.Event()
        self._posted = anyio.Event()
        self._loop = asyncio.get_running_loop()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self.stage.attach(tg)
            tg.start_soon(self._take_posts)
            task_status.started()
            await self._stop.wait()
            tg.cancel_scope.cancel()

    async def _take_posts(self) -> None:
        """Run the posted calls, in order, in a task of the stage's loop (where they may start tasks)."""
        while True:
            assert self._posted is not None
            await self._posted.wait()
            self._posted = anyio.Event()  # set by the next post's wake-up, which comes after this
            while self._posts:
                fn, args = self._posts.popleft()
                try:
                    fn(*args)
                except Exception:  # a bug of one call: the stage and the later calls go on
                    logger.exception("engine grammars: a call posted by the decode loop failed")

    def _wake_taker(self) -> None:
        assert self._posted is not None
        self._posted.set()

    def _post(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the stage's loop soon; the caller does not wait for it."""
        assert self._loop is not None
        self._posts.append((fn, args))
        with contextlib.suppress(RuntimeError):  # the loop has closed: the process is stopping
            self._loop.call_soon_threadsafe(self._wake_taker)

    def _start(self, func: Callable[..., Awaitable[Any]], *args: Any) -> Future[Any]:
        """A task of the stage's loop running ``func(*args)``: its outcome in the future returned
        (cancelled if the stage stops first)."""
        future: Future[Any] = Future()

        async def run() -> None:
            try:
                result = await func(*args)
            except anyio.get_cancelled_exc_class():
                future.cancel()
                raise
            except BaseException as exc:
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                future.set_result(result)

        assert self._tg is not None
        self._post(self._tg.start_soon, run)
        return future

    def _compile(self, spec: GrammarSpec) -> Future[CompiledConstraint]:
        return self._start(self._for_add, spec)

    async def _for_add(self, spec: GrammarSpec) -> CompiledConstraint:
        """The constraint of an add's spec. Its verdict was the request's use of it: a stand-in found
        cached here is not another use (a hit of one starts xgrammar's compile, which the stage leaves
        to a spec's second request), so an add racing its verdict's compile starts none."""
        entry = self.stage.lookup(spec)
        if isinstance(entry, CompiledConstraint):
            self.stage.mark_used(spec)
            return entry
        return await self.stage.compile(spec)

    @property
    def owes(self) -> bool:
        """Whether an answer (a verdict, ``GrammarsIdle``) is still to be sent: the decode loop says it
        is alive meanwhile, since the serving process's hang deadline runs while it waits."""
        return bool(self._owed)

    def _answered(self, message: GrammarVerdict | GrammarsIdle) -> None:
        self._send(message)
        self._owed.discard(message.token)

    def verdict(self, token: int, spec: GrammarSpec) -> None:
        """Compile ``spec`` (or find it cached) and send its verdict; a stand-in's is followed by an
        unasked verdict (token 0) once xgrammar's compile, if one runs (from the spec's second
        verdict on), has replaced it."""
        self._owed.add(token)
        self._start(self._answer, token, spec)

    async def _answer(self, token: int, spec: GrammarSpec) -> None:
        outcome: CompiledConstraint | BaseException
        try:
            outcome = await self.stage.compile(spec)
        except Exception as exc:
            outcome = exc
        verdict = verdict_of(token, outcome, self.stage)
        self._answered(verdict)
        if not verdict.is_stand_in or spec.key in self._watched:
            return
        self._watched.add(spec.key)  # one unasked verdict per replacement, however many asked
        try:
            await self.stage.wait_replaced(spec)
        finally:
            self._watched.discard(spec.key)
        entry = self.stage.lookup(spec)
        if isinstance(entry, CompiledConstraint) and not entry.is_stand_in:
            self._send(msgspec.structs.replace(verdict_of(0, entry, self.stage), key=spec.key))

    def idle(self, token: int) -> None:
        """Send ``GrammarsIdle(token)`` once no compile runs."""
        self._owed.add(token)
        future = self._start(self.stage.wait_idle)
        future.add_done_callback(lambda _: self._answered(GrammarsIdle(token)))

    def cached(self, spec: GrammarSpec) -> Any | None:
        """The compiled grammar of ``spec`` if the stage's cache holds it (one dictionary read from the
        decode loop's thread: atomic under the GIL, while the stage's loop may store beside it). A
        grammar found is a use: the serving process asks again only when its own cache misses, so
        without it a spec in constant use would be the first evicted here."""
        entry = self.stage.lookup(spec)
        if not isinstance(entry, CompiledConstraint):
            return None
        # on the stage's loop: reordering the cache from this thread could break an eviction's walk there
        self._post(self.stage.mark_used, spec)
        return entry.grammar

    def grammar_of(self, spec: GrammarSpec) -> Future[Any]:
        """The compiled grammar of ``spec`` once its compile ends (the engine's fill waits for it)."""
        grammar: Future[Any] = Future()

        def settle(compiled: Future[CompiledConstraint]) -> None:
            error = compiled.exception() if not compiled.cancelled() else RuntimeError("the compile was cancelled")
            if error is not None:
                grammar.set_exception(error)
            else:
                grammar.set_result(compiled.result().grammar)

        self._compile(spec).add_done_callback(settle)
        return grammar

    def get(self, spec: GrammarSpec) -> Future[CompiledConstraint]:
        """The compiled constraint of an add's spec (a cache hit: done within microseconds)."""
        future = self._compile(spec)
        future.add_done_callback(lambda _: self._on_done())
        return future

    def close(self) -> None:
        """Stop the stage's loop (compile threads still running are left to the process's exit)."""
        with contextlib.suppress(Exception):
            if self._stop is not None:
                self._portal.call(self._stop.set)
            self._host.result(timeout=10)
        self._exit.close()
