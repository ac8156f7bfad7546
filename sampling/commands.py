"""The engine's commands and the streams its requests' outputs arrive on: what ``AsyncEngine`` (the
engine thread) and the engine process's client share with the pipeline above them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from pipeline.outcome import Mailbox
from sampling.inputs import EngineInput, SeqOutput

__all__ = ["Add", "Barrier", "Command", "EngineQueueFull", "OutputStream", "Stop", "deliver"]


class EngineQueueFull(Exception):
    """``submit`` without room in the engine's command queue: its caller did not await ``wait_room`` first."""


@dataclass(slots=True)
class Add:
    inp: EngineInput
    is_aborted: bool = False  # set on the event loop by an abort that comes before the add is handled


@dataclass(frozen=True, slots=True)
class Barrier:
    """Set ``reached`` (on the event loop) once every command queued before it has been handled."""

    reached: anyio.Event


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Add | Barrier | Stop


class OutputStream:
    """Outputs of one request in order; ends when all ``n`` of its sequences have finished."""

    def __init__(self, add: Add, n: int) -> None:
        self.add = add
        self.request_id = add.inp.request_id
        self.n = n
        self._mailbox: Mailbox[SeqOutput] = Mailbox()
        self._num_finished = 0

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (its reader gets what was pushed first)."""
        self._mailbox.close(error)

    def push(self, output: SeqOutput) -> None:
        self._mailbox.put(output)
        if output.finish_reason is not None:
            self._num_finished += 1
            if self._num_finished >= self.n:
                self._mailbox.close()

    @property
    def is_finished(self) -> bool:
        return self._mailbox.is_closed

    def __aiter__(self) -> AsyncIterator[SeqOutput]:
        return aiter(self._mailbox)


def deliver(streams: dict[str, OutputStream], outputs: list[SeqOutput]) -> None:
    """Push one step's outputs to their requests' streams (on the event loop); a finished stream
    leaves ``streams``, an output of a request aborted meanwhile is dropped."""
    for output in outputs:
        stream = streams.get(output.request_id)
        if stream is None:
            continue
        stream.push(output)
        if stream.is_finished:
            del streams[output.request_id]
