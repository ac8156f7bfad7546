"""What the serving process tells the engine process to load, and the tracer the engine process's steps
record into (both needed on either side: the factory builds with them, the server runs with them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.engine.wire import TracedSpan

__all__ = ["EngineProcessSpec", "SpanBuffer"]


@dataclass(frozen=True, slots=True)
class EngineProcessSpec:
    """What the engine process loads."""

    config: PipelineConfig
    checkpoint_path: str
    device: str
    trace: bool = False  # trace the engine's steps (the serving process's tracer records them)
    encodes: bool = False  # the vision encoder runs here (pipeline/engine/images.py)


class SpanBuffer:
    """The engine's tracer here: its step spans wait for the next ``Step`` to carry them across."""

    def __init__(self) -> None:
        self._spans: list[TracedSpan] = []

    def span(self, name: str, cat: str, request_id: str | None, start: float, end: float, **args: Any) -> None:
        """``Tracer.span``'s interface (the engine's spans have no request)."""
        self._spans.append(TracedSpan(name, cat, start, end, args))

    def take(self) -> list[TracedSpan]:
        """The spans kept since the last call (the stepping thread records them, the same one takes them)."""
        spans, self._spans = self._spans, []
        return spans
