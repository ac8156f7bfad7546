"""The engine process: the ``LLMEngine`` (scheduler, model, sampler, grammar matchers) in its own interpreter.

The serving process keeps the event loop; here the decode loop runs without sharing a GIL with it.
The serving process's side is ``pipeline.engine.client``; the messages are in
``pipeline.engine.wire``. Over one Unix socket pair:

    serving process                          engine process
    (parent pid, EngineProcessSpec,          parent-death signal, attach the arena
     the engine arena's descriptor) ─────▶   (inherited), load the model
                                        ◀──  Ready(pid)   (or Fatal(message), then exit)
    ("grammar", token, spec) ────────────▶ ◀── GrammarVerdict(token, backend or error)   (at admission:
                                             the compile overlaps preparation; ``grammars``)
    ("add", AddCommand) ─────────────────▶   copy its tensors out of the arena, encode its images
                                             (the vision encoder here, ``images``: just in time, as
                                             the scheduler's waiting line empties), find its grammar
                                             (compiled, or compiling: then add once it has, or at
                                             once when sent before its verdict), then add
    ("abort", request id) ───────────────▶   freed before the next step
    ("barrier", token) ──────────────────▶ ◀── BarrierReached(token, figures)
    ("timeline", token, since) ──────────▶ ◀── StepTimeline(token, steps)   (record_step_timeline)
    ("grammars_idle", token) ────────────▶ ◀── GrammarsIdle(token)   once no compile runs
                                        ◀──  Step(outputs of all sequences, figures, traced step spans)
                                             once per step
                                        ◀──  Alive, after a quarter second without a message while it
                                             has work or compiles a grammar whose verdict is awaited
    ("stop",) ───────────────────────────▶   exits

``pipeline.engine.process_main`` starts it; ``pipeline.engine.spec`` says what it loads.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pipeline.engine.arena import EngineArena
from pipeline.engine.grammars import EngineGrammars
from pipeline.engine.images import EngineImages, ImagePlan
from pipeline.engine.spec import EngineProcessSpec, SpanBuffer
from pipeline.engine.wire import (
    ENCODER,
    Alive,
    BarrierReached,
    FrameReader,
    ImagesLost,
    Step,
    StepTimeline,
    decode_input,
    frame,
)
from sampling.async_engine import decoding_stats, prefix_figures
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput
from sampling.timeline import steps_since
from vision.checkpoint import Checkpoint

__all__ = ["ALIVE_EVERY_S", "EngineServer", "figures"]

# a message at least this often while the engine has work or owes an answer (the hang detector reads
# it): well under the shortest hang deadline that makes sense (a second), so that deadline holds on a
# loaded machine while a grammar compiles for many seconds. Four small frames a second, only while
# the engine owes and has no step to report.
ALIVE_EVERY_S = 0.25


logger = logging.getLogger(__name__)


def figures(engine: LLMEngine) -> tuple[dict[str, int], dict[str, int], dict[str, int] | None]:
    """The engine's figures: decoding now (/health), what it holds (leak checks), its prefix cache."""
    stats = decoding_stats(engine)
    held = {"engine_requests": engine.num_requests, "kv_blocks_used": stats["kv_blocks_used"]}
    return stats, held, prefix_figures(engine)


@dataclass(eq=False)
class _ToEncode:
    """An add whose images wait for the encoder (their plans are followed in the order the adds came)."""

    inp: EngineInput
    plan: ImagePlan
    command: int  # the add's command number (what ``ImagesLost`` names)
    aborted: bool = False  # encoded all the same (the plan keeps its images for later requests), not added


class _Waiting:
    """An add whose grammar is compiling."""

    def __init__(self, inp: EngineInput, flight: Future[Any]) -> None:
        self.inp = inp
        self.flight = flight


class EngineServer:
    """The engine process's loop: read commands, step, send each step's outputs."""

    def __init__(
        self,
        sock: socket.socket,
        engine: LLMEngine,
        spec: EngineProcessSpec,
        checkpoint: Checkpoint,
        arena: EngineArena | None = None,
        spans: SpanBuffer | None = None,
        images: EngineImages | None = None,
    ):
        self.sock = sock
        self.images = images  # the vision encoder, where it runs here
        self.arena = arena
        self.engine = engine
        self.spans = spans
        self._reader = FrameReader()
        self._wake_r, self._wake_w = os.pipe()
        self._send_lock = threading.Lock()  # verdicts are sent from the grammar stage's thread
        self.grammars = EngineGrammars(spec.config, checkpoint, send=self.send, on_done=self._wake)
        self._waiting: dict[str, _Waiting] = {}
        self._failed: list[SeqOutput] = []  # adds that failed as they were read (their images did not encode)
        # adds with images, in order, and the answers owed to the barriers and idle checks sent after
        # them (``_encode_queued`` says when they are encoded)
        self._to_encode: deque[_ToEncode | Callable[[], None]] = deque()
        self._max_waiting = max(1, spec.config.prefill_seqs_per_step)
        self._queued_said = 0  # encodes queued, as the serving process was last told (it bounds its adds by it)
        self._num_read = 0
        self._num_acked = 0  # the count of commands read that the serving process was last told
        self._sent_at = time.monotonic()

    def _wake(self) -> None:
        os.write(self._wake_w, b".")  # from a compile thread: the loop may be asleep in select

    def send(self, message: Any) -> None:
        data = frame(ENCODER.encode(message))
        with self._send_lock:
            self.sock.sendall(data)
        self._sent_at = time.monotonic()
        if isinstance(message, Step | BarrierReached | Alive):
            self._num_acked = message.acked

    def _figures(self) -> tuple[dict[str, int], dict[str, int], dict[str, int] | None]:
        stats, held, prefix = figures(self.engine)
        held["engine_requests"] += len(self._waiting)
        held["engine_requests"] += sum(1 for e in self._to_encode if isinstance(e, _ToEncode) and not e.aborted)
        if self.images is not None:
            held["images_held"] = len(self.images.held)
            held["encodes_queued"] = self._queued_said = self._num_queued()
        return stats, held, prefix

    def _num_queued(self) -> int:
        return sum(1 for e in self._to_encode if isinstance(e, _ToEncode))

    def serve(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_work() or bool(self._to_encode)
            owes = bool(self._waiting) or self.grammars.owes  # answers the serving process awaits
            # owed: wake when the next Alive is due (a command read meanwhile does not postpone it)
            timeout = 0.0 if busy else (max(0.0, self._sent_at + ALIVE_EVERY_S - time.monotonic()) if owes else None)
            if not self._read(timeout):
                return
            self._encode_queued()
            outputs, self._failed = self._failed + self._admit_compiled(), []
            if engine.has_work():
                outputs += engine.step()
            spans = self.spans.take() if self.spans is not None else []
            if outputs or spans or self._queued_said != self._num_queued():
                self.send(Step(outputs, self._num_read, *self._figures(), spans=spans))
            elif self._num_read != self._num_acked:
                # commands read and no step to say so (adds aborted at once, a barrier's aborts, a
                # client gone mid-answer): the serving process bounds the commands it has not seen
                # read, and the figures go with it, since an abort may have left the engine idle
                # (/health and /metrics would show the last step's sequences until the next request)
                self.send(Step([], self._num_read, *self._figures()))
            elif (busy or owes) and time.monotonic() - self._sent_at >= ALIVE_EVERY_S:
                self.send(Alive(self._num_read))

    def _read(self, timeout: float | None) -> bool:
        """Handle every command that has arrived (waiting up to ``timeout`` for one); False: stop."""
        waited: list[Any] = [self.sock, self._wake_r]
        readable, _, _ = select.select(waited, [], [], timeout)
        if self._wake_r in readable:
            os.read(self._wake_r, 4096)
        while self.sock in readable:
            data = self.sock.recv(1 << 20)
            if not data:
                return False  # the serving process closed the socket or died
            for body in self._reader.feed(data):
                self._num_read += 1
                if not self._handle(pickle.loads(body)):
                    return False
            readable, _, _ = select.select([self.sock], [], [], 0)
        return True

    def _handle(self, command: tuple[Any, ...]) -> bool:
        kind = command[0]
        if kind == "add":
            # copied out of the arena now: the acknowledgement of this command frees its region
            add = command[1]
            inp = decode_input(add, self.arena)
            if add.images is not None:
                self._to_encode.append(_ToEncode(inp, add.images, self._num_read))
            else:
                self._add(inp)
        elif kind == "abort":
            request_id = command[1]
            for queued in self._to_encode:
                if isinstance(queued, _ToEncode) and queued.inp.request_id == request_id:
                    queued.aborted = True
            if self._waiting.pop(request_id, None) is None:
                self.engine.abort(request_id)  # a no-op for a request that finished
        elif kind == "barrier":
            self._after_queued(functools.partial(self._barrier, command[1]))
        elif kind == "grammar":
            self.grammars.verdict(command[1], command[2])
        elif kind == "grammars_idle":  # an add still queued may start a compile when it is added
            self._after_queued(functools.partial(self.grammars.idle, command[1]))
        elif kind == "timeline":
            since = command[2]
            self.send(StepTimeline(command[1], steps_since(self.engine.timeline, since)))
        elif kind == "stop":
            return False
        return True

    def _barrier(self, token: int) -> None:
        if self._failed:  # the adds before the barrier that failed say so first
            failed, self._failed = self._failed, []
            self.send(Step(failed, self._num_read, *self._figures()))
        self.send(BarrierReached(token, self._num_read, *self._figures()))

    def _after_queued(self, answer: Callable[[], None]) -> None:
        """Run ``answer`` once the adds queued before it are encoded and added (now if none is)."""
        if self._to_encode:
            self._to_encode.append(answer)
        else:
            answer()

    def _encode_queued(self) -> None:
        """Encode the next queued add's images and add it, just in time: once the scheduler has fewer
        than ``prefill_seqs_per_step`` requests waiting for their prefill. So requests wait here with
        their pixels (in host memory) rather than with their embeddings, and a burst of images delays
        a step by one request's encodes at most (adds of held images only need no encoder)."""
        while self._to_encode:
            queued = self._to_encode[0]
            if not isinstance(queued, _ToEncode):
                self._to_encode.popleft()
                queued()
                continue
            if len(self.engine.scheduler.waiting) >= self._max_waiting:
                return
            self._to_encode.popleft()
            started = time.perf_counter()
            ready = self._encoded(queued)
            if ready is not None and not queued.aborted:
                self._add(ready)
            encoded = sum(queued.plan.send)
            if encoded:
                if self.spans is not None:
                    self.spans.span("vision encode", "engine", None, started, time.perf_counter(), images=encoded)
                return

    def _encoded(self, queued: _ToEncode) -> EngineInput | None:
        """The add's input with its images' embeddings in; None: they could not be encoded (the request fails)."""
        inp, plan = queued.inp, queued.plan
        try:
            if self.images is None:
                raise RuntimeError("this engine process has no vision encoder")
            return self.images.resolve(inp, plan)
        except Exception as exc:
            logger.exception("engine process: the images of request %s could not be encoded", inp.request_id)
            message = f"the engine process could not encode the request's images: {type(exc).__name__}: {exc}"
            self._failed += _error_outputs(inp, message)
            lost = [key.content_hash for key, keep in zip(inp.image_keys, plan.keep, strict=True) if keep]
            if lost:  # the serving process's index counts them held: it forgets them
                self.send(ImagesLost(queued.command, lost))
            return None

    def _add(self, inp: EngineInput) -> None:
        if inp.grammar_source is None:
            self.engine.add(inp)
            return
        _, spec = inp.grammar_source  # the backend is the cache's: xgrammar's once it replaced a stand-in
        grammar = self.grammars.cached(spec)  # compiled since its verdict, almost always
        if grammar is None and inp.grammar_pending:
            # sent before its verdict (a short preparation): it prefills while the grammar compiles,
            # its sampling chunk waits for the compile (a refusal fails it there, unsampled)
            grammar = self.grammars.grammar_of(spec)
        if grammar is None:
            self._waiting[inp.request_id] = _Waiting(inp, self.grammars.get(spec))
            return
        inp.grammar = grammar
        self.engine.add(inp)

    def _admit_compiled(self) -> list[SeqOutput]:
        """Add the requests whose grammar has compiled; the outputs of those whose compile failed."""
        failed: list[SeqOutput] = []
        for request_id, waiting in list(self._waiting.items()):
            if not waiting.flight.done():
                continue
            del self._waiting[request_id]
            inp = waiting.inp
            try:
                inp.grammar = waiting.flight.result().grammar
            except Exception as exc:  # its verdict was a success: evicted since and now refused (a fault)
                failed += _error_outputs(inp, f"the engine process could not compile the request's grammar: {exc}")
                continue
            self.engine.add(inp)
        return failed


def _error_outputs(inp: EngineInput, message: str) -> list[SeqOutput]:
    """The outputs that end each of ``inp``'s sequences with ``message`` (an error, nothing sampled)."""
    return [SeqOutput(inp.request_id, i, [], "", finish_reason="error", error=message) for i in range(inp.sampling.n)]
