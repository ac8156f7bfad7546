"""The messages between the serving process and the engine process, and their frames.

A frame is a 4-byte little-endian length and a body, over one Unix socket pair. Chosen by measurement
(this 2-core machine, a socket pair between two Python processes): a 32-byte frame's round trip is
8 us; one step's outputs for 32 sequences encode in 11 us and decode in 16 us with msgspec's msgpack
(pickle: 74 and 50 us), so the per-step messages from the engine are msgspec, typed. Commands go the
other way once per request (or abort), so they are pickled: an ``EngineInput`` with a ``GrammarSpec``
and sampling parameters; its tensors (image embeddings, ``extra_prefill``) in the engine arena's shared
memory (``pipeline.engine.arena``), or as raw bytes in the frame when they do not fit there (about
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

from pipeline.engine.arena import EngineArena, Tensors
from pipeline.engine.images import ImagePlan
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
    "ImagesLost",
    "Ready",
    "Step",
    "StepTimeline",
    "TracedSpan",
    "decode_input",
    "check_crossable",
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


class ImagesLost(msgspec.Struct, tag="images_lost"):
    """Sent unasked when an add's images failed to encode: the engine process keeps none of them,
    though the add (command number ``command``) told it to keep ``hashes``."""

    command: int
    hashes: list[str]


class GrammarsIdle(msgspec.Struct, tag="grammars_idle"):
    """The answer to ``("grammars_idle", token)``: no compile is running in the engine process."""

    token: int


FromEngine = Ready | Fatal | Step | BarrierReached | StepTimeline | Alive | GrammarVerdict | GrammarsIdle | ImagesLost
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(FromEngine)


# -- to the engine process (pickle) -------------------------------------------------------------
Raw = tuple[tuple[int, ...], str, bytes]  # a tensor inline in a frame: shape, dtype name, raw bytes


@dataclass(frozen=True, slots=True)
class AddCommand:
    """An ``EngineInput`` as it crosses: its fields but the compiled grammar; its tensors either in the
    engine arena (``shared``: where) or inline (``embeds`` and ``pixels`` as bytes, ``extra_prefill``
    in ``values``). With the vision encoder in the engine process, ``images`` says what to do with
    the images, and only the pixels it says cross do (pipeline/engine/images.py)."""

    values: dict[str, Any]  # every field of the EngineInput but grammar, image_embeds and image_pixels
    embeds: Raw | None  # image_embeds
    shared: Tensors | None = None  # image_embeds, extra_prefill and pixels, in the arena (values lack extra_prefill)
    images: ImagePlan | None = None
    pixels: tuple[Raw | None, ...] = ()  # inline: per image key, its pixels where they cross


_KEPT = tuple(f.name for f in fields(EngineInput) if f.name not in ("grammar", "image_embeds", "image_pixels"))
_EXTRA = "extra_prefill."  # the prefix of an extra_prefill tensor's name in the arena
_PIXELS = "pixels."  # the prefix of an image's pixels in the arena, then its index among the keys


def _raw(tensor: torch.Tensor) -> Raw:
    tensor = tensor.detach().cpu().contiguous()
    raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), raw


def _tensor(raw: Raw) -> torch.Tensor:
    shape, dtype_name, data = raw
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype_name)).view(shape)


def check_crossable(inp: EngineInput) -> None:
    """:raises ValueError: ``inp`` cannot cross: a grammar without its source, or an image without pixels."""
    if inp.grammar is not None and inp.grammar_source is None:
        raise ValueError("a grammar without its source cannot cross to the engine process")
    if any(p is None for p in inp.image_pixels):
        raise ValueError("an image without its pixels cannot cross to the engine process")


def encode_input(inp: EngineInput, arena: EngineArena | None = None, images: ImagePlan | None = None) -> AddCommand:
    """What crosses for ``inp`` (its compiled grammar stays: the engine process compiles its source).

    Its tensors go into ``arena`` when given and they fit there, else inline in the frame. ``images``:
    the plan of ``inp``'s ``image_pixels`` (only the pixels it sends cross).

    :raises ValueError: ``inp`` cannot cross (``check_crossable``), or has pixels but no plan.
    """
    check_crossable(inp)
    if bool(inp.image_pixels) != (images is not None):
        raise ValueError("an add's image pixels cross with their plan, and only then")
    values = {name: getattr(inp, name) for name in _KEPT}
    sent = {i: p for i, p in enumerate(inp.image_pixels) if images is not None and images.send[i] and p is not None}
    if arena is not None and (inp.image_embeds is not None or sent):
        tensors = {"image_embeds": inp.image_embeds} if inp.image_embeds is not None else {}
        tensors |= {_EXTRA + k: v for k, v in inp.extra_prefill.items()}
        tensors |= {f"{_PIXELS}{i}": p for i, p in sent.items()}
        shared = arena.put(tensors)
        if shared is not None:
            values["extra_prefill"] = {}
            return AddCommand(values, None, shared, images)
    embeds = _raw(inp.image_embeds) if inp.image_embeds is not None else None
    pixels = tuple(_raw(sent[i]) if i in sent else None for i in range(len(inp.image_pixels)))
    return AddCommand(values, embeds, None, images, pixels)


def decode_input(add: AddCommand, arena: EngineArena | None = None) -> EngineInput:
    """The ``EngineInput`` again, without its grammar (the engine process compiles it); tensors in the
    arena are copied out of it (its region is freed once the serving process learns this add was read).
    The pixels of images the plan does not send are None (``EngineImages.resolve`` fills the embeddings in).

    :raises ValueError: the add's tensors are in an arena but none is given.
    """
    num_images = len(add.images.send) if add.images is not None else 0
    if add.shared is not None:
        if arena is None:
            raise ValueError("an add's tensors are in the engine arena but this process has none")
        tensors = arena.take(add.shared)
        extra = {name.removeprefix(_EXTRA): t for name, t in tensors.items() if name.startswith(_EXTRA)}
        pixels = [tensors.get(f"{_PIXELS}{i}") for i in range(num_images)]
        return EngineInput(
            **(add.values | {"extra_prefill": extra}), image_embeds=tensors.get("image_embeds"), image_pixels=pixels
        )
    image_embeds = _tensor(add.embeds) if add.embeds is not None else None
    pixels = [_tensor(raw) if raw is not None else None for raw in add.pixels]
    return EngineInput(**add.values, image_embeds=image_embeds, image_pixels=pixels)


def encode_command(command: tuple[Any, ...]) -> bytes:
    """One command as a frame: ``("add", AddCommand)``, ``("abort", id)``, ``("barrier", token)``,
    ``("timeline", token, since)``, ``("grammar", token, spec)``, ``("grammars_idle", token)``, ``("stop",)``."""
    return frame(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
