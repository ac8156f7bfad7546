"""The engine process's lifecycle, seen from the serving process: start it, stop it, and start another
when it dies or hangs (the half of ``ProcessEngine`` that keeps one running; pipeline/engine/client.py
is the half that talks to it).

Faults: an engine process that dies (kill -9, out of memory, a native crash), or that makes no progress
for ``step_timeout_s`` while it owes work (requests it holds, answers awaited: it is then killed), fails
the requests it held and the answers awaited with ``EngineFailed`` (503, retryable); requests submitted
while a new one starts get the same; a new process (the model loaded again) is started in the
background and serves what comes after.
``status`` says which (``/health`` reports it).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import anyio
from anyio.abc import TaskGroup

from pipeline.engine.arena import EngineArena
from pipeline.engine.link import EngineLink
from pipeline.engine.spec import EngineProcessSpec
from pipeline.errors import EngineFailed
from sampling.async_engine import OutputStream

__all__ = ["EngineSupervisor"]

logger = logging.getLogger(__name__)

_RESTART_PAUSE_S = 1.0  # between attempts when a new engine process fails to start


class EngineSupervisor:
    """One engine process at a time, started again after a failure; ``_on_message`` is the subclass's."""

    def __init__(
        self,
        spec: EngineProcessSpec,
        *,
        step_timeout_s: float,
        start_timeout_s: float,
        retry_after_s: float,
        arena_bytes: int,
    ) -> None:
        self.spec = spec
        self.arena_bytes = arena_bytes  # 0: no arena, every add's tensors inline
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.retry_after_s = retry_after_s
        self.status = "starting"  # "ok", "restarting", "stopped"
        self._started = anyio.Event()  # set while status is "ok"
        self.num_failures = 0
        self._link: EngineLink | None = None
        self._streams: dict[str, OutputStream] = {}
        self._barriers: dict[int, anyio.Event] = {}
        self._num_sent = 0
        self._num_acked = 0
        self._arena: EngineArena | None = None
        self._progress_at = time.monotonic()
        self._hung = False
        self._closing = False
        self._tg: TaskGroup | None = None
        self._stats: dict[str, int] = {}
        self._held: dict[str, int] = {}

    @property
    def pid(self) -> int | None:
        """The engine process's id (None while none runs)."""
        return self._link.pid if self._link is not None else None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded. :raises EngineFailed: it could not."""
        await self._launch()
        self._set_ok()

    def _set_ok(self) -> None:
        self.status = "ok"
        self._started.set()

    async def wait_started(self) -> None:
        """Return once an engine process serves (at once unless one is starting after a failure)."""
        await self._started.wait()

    def attach(self, tg: TaskGroup) -> None:
        """Where the hang watchdog runs and new engine processes are started after a failure."""
        self._tg = tg
        tg.start_soon(self._watch)
        if self.status == "restarting" and self._link is not None:
            # lost after its start, while the pipeline still loaded: there was no task group to start
            # another in then
            tg.start_soon(self._restart, self._link)

    async def aclose(self) -> None:
        """Stop the engine process (a stop message, then SIGKILL after a grace period) and wait for it."""
        self._closing = True
        was_serving, self.status = self.status == "ok", "stopped"
        link, self._link = self._link, None
        if link is not None:
            await link.close(kill=not was_serving)  # one still loading its model would read the stop late
            self._drop_arena(link)
        self._release_barriers()

    async def _launch(self) -> None:
        arena = EngineArena.create(self.arena_bytes) if self.arena_bytes else None
        link = EngineLink(
            self.spec,
            on_message=lambda m: self._on_message(link, m),
            on_lost=lambda: self._on_lost(link),
            arena=arena,
        )
        self._link, self._arena = link, arena
        self._num_sent = self._num_acked = 0
        try:
            await link.open(self.start_timeout_s, self.retry_after_s)
        except BaseException:
            self._drop_arena(link)
            raise
        logger.info("engine process %s ready", link.pid)

    def _drop_arena(self, link: EngineLink) -> None:
        """Close ``link``'s arena (its process is gone: the memory is freed when both ends are closed)."""
        if link.arena is not None:
            if link.arena is self._arena:
                self._arena = None
            link.arena.close()
            link.arena = None

    def _owes_work(self) -> bool:
        """Whether the engine process owes the serving process something (the hang deadline runs)."""
        return bool(self._streams)

    def _fail_owed(self, error: EngineFailed) -> None:
        """Fail what the lost engine process owed with ``error``."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(copy.copy(error))  # each its own: its request binds its id to it

    def _on_lost(self, link: EngineLink) -> None:
        if link is not self._link:
            return
        if self._closing or self.status != "ok":
            self._release_barriers()
            return
        self.status = "restarting"
        self._started = anyio.Event()
        self.num_failures += 1
        why = f"made no progress for {self.step_timeout_s:g} s" if self._hung else "died"
        logger.error("engine process %s %s holding %d requests; starting another", link.pid, why, len(self._streams))
        error = EngineFailed(
            f"the decode engine process {why} while it held this request; retry",
            retry_after=self.retry_after_s,
            stage="engine",
        )
        self._fail_owed(error)
        self._release_barriers()
        if self._arena is not None:  # nobody reads the regions any more; _restart closes the arena
            self._arena.reset()
        self._held, self._stats, self._hung = {}, {}, False
        if self._tg is not None:
            self._tg.start_soon(self._restart, link)

    def _release_barriers(self) -> None:
        barriers, self._barriers = self._barriers, {}
        for reached in barriers.values():
            reached.set()

    # -- in the background ----------------------------------------------------------------------
    async def _restart(self, failed: EngineLink) -> None:
        await failed.close(kill=True)
        self._drop_arena(failed)
        while not self._closing:
            try:
                await self._launch()
            except Exception:
                logger.exception("a new engine process could not start; trying again")
                await anyio.sleep(_RESTART_PAUSE_S)
                continue
            if self._closing:
                return
            link = self._link
            if link is not None and link.is_open:
                self._set_ok()
                return
            if link is not None:  # it died between its Ready and here: reap it and start another
                await link.close(kill=True)
                self._drop_arena(link)

    async def _watch(self) -> None:
        """Kill an engine process that owes work and has sent nothing for ``step_timeout_s``."""
        while True:
            await anyio.sleep(min(1.0, self.step_timeout_s / 4))
            link = self._link
            stalled = time.monotonic() - self._progress_at > self.step_timeout_s
            if self.status == "ok" and self._owes_work() and stalled and link is not None and not self._hung:
                logger.error("engine process %s made no progress for %.0f s: killed", link.pid, self.step_timeout_s)
                self._hung = True
                link.kill()

    def _on_message(self, link: EngineLink, message: Any) -> None:
        """A message from ``link``'s engine process (the subclass handles them)."""
        raise NotImplementedError
