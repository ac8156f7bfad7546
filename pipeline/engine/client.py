"""ProcessEngine: the decode engine in its own process, seen from the serving process as ``AsyncEngine`` is.

The pipeline uses either through the same calls (``submit``, ``abort``, ``barrier``, ``stats``,
``resources``, ``start``, ``aclose``), so nothing above the engine knows which runs. Commands go
through the engine process's link (``pipeline.engine.link``: the event loop's own transport,
never blocking); each engine step's outputs arrive in one message and are handed to their streams
there, as ``AsyncEngine`` hands them over once per step.

Starting the engine process, and another after it dies or hangs, is ``EngineSupervisor``'s
(``pipeline.engine.supervisor``), which ``ProcessEngine`` extends.

An add waits for room first (``wait_room``): at most ``queue_size`` commands the engine has not
acknowledged reading (it reads between steps); the acknowledgements wake the waiters, and a lost
engine process fails them as it fails the requests it held.

An add's tensors cross in the engine process's arena (``pipeline.engine.arena``): a region is
taken at ``submit`` (after the wait: a request waiting for room holds none) and freed when the engine
acknowledges having read the add (it copies the tensors out then); a fault frees them all, and the new
process gets a new arena.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio

from pipeline.engine.images import ImageIndex
from pipeline.engine.link import EngineLink
from pipeline.engine.spec import EngineProcessSpec
from pipeline.engine.supervisor import EngineSupervisor
from pipeline.engine.wire import (
    Alive,
    BarrierReached,
    GrammarsIdle,
    GrammarVerdict,
    ImagesLost,
    Step,
    StepTimeline,
    check_crossable,
    encode_input,
)
from pipeline.errors import EngineFailed
from pipeline.observability.trace import Tracer
from pipeline.outcome import Outcome
from sampling.async_engine import Add, EngineQueueFull, OutputStream, deliver
from sampling.command_room import CommandRoom
from sampling.inputs import EngineInput, SeqOutput
from sampling.timeline import StepTiming

__all__ = ["ProcessEngine"]

# an add's region lives until the engine has read it (milliseconds): room for a burst of adds of
# ~10 MB of embeddings each; pages are only allocated where written. Adds that do not fit cross inline.
ARENA_BYTES = 256 << 20


class ProcessEngine(EngineSupervisor):
    """The client of one engine process (started again after a failure)."""

    def __init__(
        self,
        spec: EngineProcessSpec,
        *,
        queue_size: int,
        step_timeout_s: float,
        start_timeout_s: float,
        retry_after_s: float,
        token_table: Callable[[], list[bytes]],
        arena_bytes: int = ARENA_BYTES,
        tracer: Tracer | None = None,
        images: ImageIndex | None = None,
    ) -> None:
        super().__init__(
            spec,
            step_timeout_s=step_timeout_s,
            start_timeout_s=start_timeout_s,
            retry_after_s=retry_after_s,
            arena_bytes=arena_bytes,
        )
        self.tracer = tracer  # records the engine's step spans (the spec asks the process to trace)
        self.queue_size = queue_size
        self.room = CommandRoom(self._has_room)
        self._token_table = token_table
        self._timelines: dict[int, list[StepTiming]] = {}  # answers to step_timeline(), by barrier token
        self._replies: dict[int, Outcome[Any]] = {}  # answers to ask(), by token
        self.on_unasked: Callable[[Any], None] | None = None  # what the engine says unasked (token 0)
        self._num_barriers = 0
        # adds with tensors: through the arena, and inline (they did not fit it, or it is off)
        self.num_arena_adds = self.num_inline_adds = 0
        self._prefix: dict[str, int] | None = None
        # the vision encoder in the engine process: which images it holds (None: it encodes none)
        self.images = images

    async def _launch(self) -> None:
        if self.images is not None:
            self.images.reset()  # a new engine process holds no image
        await super()._launch()

    @property
    def token_table(self) -> list[bytes]:
        """Each token id's bytes (built here once: log-probability entries show them)."""
        return self._token_table()

    def build_token_table(self) -> None:
        """Build ``token_table`` now: xgrammar's tokenizer info and the table take about 1 s on the
        embedded model, so the pipeline's load does it, off the event loop."""
        self._token_table()

    # -- the pipeline's calls ---------------------------------------------------------------------
    async def wait_room(self) -> None:
        """Return once the engine has read enough commands for one more add (first come first served);
        ``submit`` before the next ``await``. Cancellable: a caller that leaves holds nothing here.

        :raises EngineFailed: the engine process is being started again, or is lost while this waits.
        """
        self._check_serving()
        if not self._owes_work():
            self._progress_at = time.monotonic()  # requests waiting are owed: the hang deadline runs
        await self.room.wait()

    def _has_room(self) -> bool:
        # adds read whose images wait for the engine's encoder count as unread: a burst of images
        # backs up here (and at admission), as it would before an encoder in this process
        unread = self._num_sent - self._num_acked + self._held.get("encodes_queued", 0)
        return unread < self.queue_size  # an acknowledgement calls notify

    def _check_serving(self) -> None:
        link = self._link
        if self.status != "ok" or link is None or not link.is_open:
            raise EngineFailed(
                "the decode engine is restarting after a failure; retry", retry_after=self.retry_after_s, stage="engine"
            )

    def submit(self, inp: EngineInput) -> OutputStream:
        """Send ``inp`` to the engine (``wait_room`` first); its outputs arrive on the returned stream.

        :raises EngineQueueFull: the engine has not read ``queue_size`` commands yet (no ``wait_room``).
        :raises EngineFailed: the engine process is being started again after a failure.
        """
        self._check_serving()
        link = self._link
        assert link is not None
        if not self._has_room():
            raise EngineQueueFull("the decode engine's queue is full")
        plan = None
        if inp.image_pixels:
            if self.images is None:
                raise ValueError("image pixels sent to an engine process that does not encode images")
            check_crossable(inp)  # before the plan: once planned, the index counts the add as sent
            plan = self.images.plan(inp.image_keys, self._num_sent + 1)
        add = encode_input(inp, self._arena, plan)
        if add.shared is not None and self._arena is not None:
            self._arena.hold_until(self._num_sent + 1)  # freed once the engine has read this add
            self.num_arena_adds += 1
        elif add.embeds is not None or any(add.pixels):
            self.num_inline_adds += 1
        command = ("add", add)
        if not self._owes_work():
            self._progress_at = time.monotonic()  # the hang deadline counts from the first work
        link.write(command)
        self._num_sent += 1
        stream = OutputStream(Add(inp), inp.sampling.n)
        self._streams[inp.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Free the request's sequences before the engine's next step (never blocks)."""
        if self._streams.pop(request_id, None) is None:
            return
        if self._link is not None and self._link.is_open:
            self._link.write(("abort", request_id))
            self._num_sent += 1

    async def barrier(self) -> None:
        """Return once the engine process has handled every command sent before this call (at once
        while no engine process runs: it holds nothing)."""
        link = self._link
        if link is None or not link.is_open or self.status != "ok":
            return
        self._num_barriers += 1
        token = self._num_barriers
        reached = self._barriers[token] = anyio.Event()
        link.write(("barrier", token))
        self._num_sent += 1
        await reached.wait()

    async def step_timeline(self, since: float = 0.0) -> list[StepTiming]:
        """The engine's steps that began at ``since`` (``time.perf_counter()``) or later, with
        ``record_step_timeline`` (empty without it, or while no engine process runs)."""
        link = self._link
        if link is None or not link.is_open or self.status != "ok":
            return []
        self._num_barriers += 1
        token = self._num_barriers
        reached = self._barriers[token] = anyio.Event()
        link.write(("timeline", token, since))
        self._num_sent += 1
        await reached.wait()
        return self._timelines.pop(token, [])

    def ask(self, *command: Any) -> tuple[int, Outcome[Any]]:
        """Send ``(command[0], token, *command[1:])``; the outcome gets the engine's answer of that
        token (``pipeline.engine.remote_grammar``), or ``EngineFailed`` if the engine process dies first
        or sends nothing for ``step_timeout_s`` while the answer is awaited (it is then killed).

        :raises EngineFailed: the engine process is being started again after a failure.
        """
        self._check_serving()
        link = self._link
        assert link is not None
        if not self._owes_work():
            self._progress_at = time.monotonic()  # an answer awaited is work: the hang deadline runs
        self._num_barriers += 1
        token = self._num_barriers
        reply = self._replies[token] = Outcome()
        link.write((command[0], token, *command[1:]))
        self._num_sent += 1
        return token, reply

    def forget(self, token: int) -> None:
        """Drop the answer of ``ask``'s ``token`` (its asker gave up waiting)."""
        self._replies.pop(token, None)

    @property
    def num_running(self) -> int:
        return len(self._streams)

    def resources(self) -> dict[str, int]:
        """What the engine holds, as of its last message (after a ``barrier``: now)."""
        return {
            "engine_requests": self._held.get("engine_requests", 0),
            "engine_streams": len(self._streams),
            "kv_blocks_used": self._held.get("kv_blocks_used", 0),
            "arena_regions": self._arena.num_regions if self._arena is not None else 0,
            "engine_replies": len(self._replies),  # grammar verdicts awaited
            "room_waiters": self.room.num_waiting,  # adds waiting for the engine to read commands
        }

    def stats(self) -> dict[str, int]:
        """Decoding as of the engine's last message, for /health and /metrics."""
        return dict(self._stats)

    def prefix_cache_figures(self) -> dict[str, int] | None:
        """The KV prefix cache's counters as of the engine's last message (None: off)."""
        return self._prefix

    # -- from the engine process --------------------------------------------------------------
    def _on_message(self, link: EngineLink, message: Any) -> None:
        if link is not self._link:
            return  # a process we have given up on
        self._progress_at = time.monotonic()
        if isinstance(message, Step):
            self._figures(message)
            self._deliver(message.outputs)
            if self.tracer is not None:
                for span in message.spans:
                    self.tracer.span(span.name, span.cat, None, span.start, span.end, **span.args)
        elif isinstance(message, BarrierReached):
            self._figures(message)
            reached = self._barriers.pop(message.token, None)
            if reached is not None:
                reached.set()
        elif isinstance(message, StepTimeline):
            reached = self._barriers.pop(message.token, None)
            if reached is not None:
                self._timelines[message.token] = message.steps
                reached.set()
        elif isinstance(message, Alive):
            self._acked(message.acked)
        elif isinstance(message, ImagesLost):
            if self.images is not None:
                self.images.forget(message.hashes, message.command)
        elif isinstance(message, GrammarVerdict) and message.token == 0:
            if self.on_unasked is not None:
                self.on_unasked(message)
        elif isinstance(message, GrammarVerdict | GrammarsIdle):
            reply = self._replies.pop(message.token, None)
            if reply is not None:
                reply.set_result(message)

    def _acked(self, acked: int) -> None:
        """The engine has read ``acked`` commands: the adds among them have their tensors copied out."""
        self._num_acked = acked
        if self._arena is not None:
            self._arena.acked(acked)
        self.room.notify()

    def _figures(self, message: Step | BarrierReached) -> None:
        self._acked(message.acked)
        self._stats, self._held, self._prefix = message.stats, message.held, message.prefix

    def _deliver(self, outputs: list[SeqOutput]) -> None:
        deliver(self._streams, outputs)

    def _owes_work(self) -> bool:
        return bool(self._streams or self._replies or self.room.num_waiting)

    def _fail_owed(self, error: EngineFailed) -> None:
        super()._fail_owed(error)
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            reply.fail(error)
        self.room.fail(error)  # the lost process will never read what was sent: nothing waits for it

    def _release_barriers(self) -> None:
        super()._release_barriers()
        stopped = EngineFailed(
            "the decode engine process stopped; retry", retry_after=self.retry_after_s, stage="engine"
        )
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            reply.fail(stopped)
        self.room.fail(stopped)
