"""The messages between the serving process and the engine process, and their frames.

A frame is a 4-byte little-endian length and a body, over one Unix socket pair. Chosen by measurement
(this 2-core machine, a socket pair between two Python processes): a 32-byte frame's round trip is
8 us; one step's outputs for 32 sequences encode in 11 us and decode in 16 us with msgspec's msgpack
(pickle: 74 and 50 us), so the per-step messages from the engine are msgspec, typed. Commands go the
other way once per request (or abort), so they are pickled: an ``EngineInput`` with a ``GrammarSpec``
and sampling parameters; its tensors (image embeddings, ``extra_prefill``) in the engine arena's shared
memory (``pipeline.core.engine_arena``), or as raw bytes in the frame when they do not fit there (about
0.7 ms per MB, one way, copies included). ZeroMQ, which vLLM and SGLang use, is not installed here and
would add nothing to a socket pair between two processes of one host.

Compiled grammars never cross (serializing one costs 3-20x its compile): the serving process sends a
new spec at admission (``("grammar", token, spec)``), the engine process compiles and caches it and
answers with a ``GrammarVerdict``; an ``Add`` carries the spec, found there in the cache.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import torch

from pipeline.core.engine_arena import EngineArena, Tensors
from sampling.inputs import EngineInput, SeqOutput
from sampling.timeline import StepTiming

__all__ = [
    "AddCommand",
    "Alive",
    "BarrierReached",
    "Fatal",
    "FrameReader",
    "GrammarVerdict",
    "GrammarsIdle",
    "Ready",
    "Step",
    "StepTimeline",
    "TracedSpan",
    "decode_input",
    "encode_command",
    "encode_input",
    "frame",
]

_HEADER = struct.Struct("<I")


def frame(body: bytes) -> bytes:
    """``body`` with its length in front."""
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Whole frames out of a byte stream that arrives in pieces."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames ``data`` completes, in order."""
        frames: list[bytes] = []
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            frames.append(bytes(buffer[start + _HEADER.size : end]))
            start = end
        del buffer[:start]
        return frames


# -- from the engine process (msgspec) ---------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    pid: int


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


class TracedSpan(msgspec.Struct, array_like=True):
    """One span the engine traced (``Tracer.span``'s arguments; ``perf_counter`` is one clock for both processes)."""

    name: str
    cat: str
    start: float
    end: float
    args: dict[str, Any]


class Step(msgspec.Struct, tag="step"):
    """One step's outputs for every sequence that produced a token, and the engine's figures after it."""

    outputs: list[SeqOutput]
    acked: int  # commands read so far
    stats: dict[str, int]
    held: dict[str, int]
    prefix: dict[str, int] | None
    spans: list[TracedSpan] = msgspec.field(default_factory=list)  # the steps traced since the last Step (--trace)


class BarrierReached(msgspec.Struct, tag="barrier"):
    token: int
    acked: int
    stats: dict[str, int]
    held: dict[str, int]
    prefix: dict[str, int] | None


class StepTimeline(msgspec.Struct, tag="timeline"):
    """The answer to ``("timeline", token, since)``: the steps recorded that began at ``since`` or later."""

    token: int
    steps: list[StepTiming]


class Alive(msgspec.Struct, tag="alive"):
    """Sent when nothing else was for a while: the engine is working (a compile, a long prefill)."""

    acked: int


class GrammarVerdict(msgspec.Struct, tag="verdict"):
    """The answer to ``("grammar", token, spec)``: which backend compiled the spec (now cached there),
    or the typed error that refused it; and the engine's compile counters after it. Token 0: sent
    unasked once xgrammar's grammar has replaced the llguidance stand-in of the spec keyed ``key``."""

    token: int
    backend: str = ""
    reason: str = ""
    is_stand_in: bool = False
    error: tuple[str, str, str | None, list[str]] | None = None  # class name, message, field, keywords
    compiles: dict[str, int] = {}  # compiles by "backend: reason"
    counters: dict[str, float] = {}  # the grammar stage's errors, timeouts, compile seconds
    key: str = ""  # the spec's, in an unasked verdict


class GrammarsIdle(msgspec.Struct, tag="grammars_idle"):
    """The answer to ``("grammars_idle", token)``: no compile is running in the engine process."""

    token: int


FromEngine = Ready | Fatal | Step | BarrierReached | StepTimeline | Alive | GrammarVerdict | GrammarsIdle
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(FromEngine)


# -- to the engine process (pickle) -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddCommand:
    """An ``EngineInput`` as it crosses: its fields but the compiled grammar; its tensors either in the
    engine arena (``shared``: where) or inline (``embeds`` as bytes, ``extra_prefill`` in ``values``)."""

    values: dict[str, Any]  # every field of the EngineInput but grammar and image_embeds
    embeds: tuple[tuple[int, ...], str, bytes] | None  # shape, dtype name, raw bytes
    shared: Tensors | None = None  # image_embeds and extra_prefill, in the arena (values lack extra_prefill)


_KEPT = tuple(f.name for f in fields(EngineInput) if f.name not in ("grammar", "image_embeds"))
_EXTRA = "extra_prefill."  # the prefix of an extra_prefill tensor's name in the arena


def encode_input(inp: EngineInput, arena: EngineArena | None = None) -> AddCommand:
    """What crosses for ``inp`` (its compiled grammar stays: the engine process compiles its source).

    Its tensors go into ``arena`` when given and they fit there, else inline in the frame.

    :raises ValueError: ``inp`` has a grammar but not its source.
    """
    if inp.grammar is not None and inp.grammar_source is None:
        raise ValueError("a grammar without its source cannot cross to the engine process")
    values = {name: getattr(inp, name) for name in _KEPT}
    if arena is not None and inp.image_embeds is not None:
        tensors = {"image_embeds": inp.image_embeds} | {_EXTRA + k: v for k, v in inp.extra_prefill.items()}
        shared = arena.put(tensors)
        if shared is not None:
            values["extra_prefill"] = {}
            return AddCommand(values, None, shared)
    embeds = None
    if inp.image_embeds is not None:
        tensor = inp.image_embeds.detach().cpu().contiguous()
        raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        embeds = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), raw)
    return AddCommand(values, embeds)


def decode_input(add: AddCommand, arena: EngineArena | None = None) -> EngineInput:
    """The ``EngineInput`` again, without its grammar (the engine process compiles it); tensors in the
    arena are copied out of it (its region is freed once the serving process learns this add was read).

    :raises ValueError: the add's tensors are in an arena but none is given.
    """
    if add.shared is not None:
        if arena is None:
            raise ValueError("an add's tensors are in the engine arena but this process has none")
        tensors = arena.take(add.shared)
        extra = {name.removeprefix(_EXTRA): t for name, t in tensors.items() if name.startswith(_EXTRA)}
        return EngineInput(**(add.values | {"extra_prefill": extra}), image_embeds=tensors["image_embeds"])
    image_embeds = None
    if add.embeds is not None:
        shape, dtype_name, raw = add.embeds
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        image_embeds = flat.view(getattr(torch, dtype_name)).view(shape)
    return EngineInput(**add.values, image_embeds=image_embeds)


def encode_command(command: tuple[Any, ...]) -> bytes:
    """One command as a frame: ``("add", AddCommand)``, ``("abort", id)``, ``("barrier", token)``,
    ``("timeline", token, since)``, ``("grammar", token, spec)``, ``("grammars_idle", token)``, ``("stop",)``."""
    return frame(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
