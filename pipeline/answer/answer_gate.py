"""AnswerGate: a structured answer leaves with finish_reason ``stop`` only after its whole text passes
the request's whole constraint (rule 7 of the README: no grammar engine is trusted to be complete).

Without streaming, a guided choice's deltas are held until it finishes; an answer that fails the
check is never shown, and the handle samples that choice again (``resample_params``). With
streaming, the text is already with the client: only the final delta (the one that carries
``stop``) is held, and an answer that fails ends the stream with an ``InvalidAnswer`` error instead.
An answer cut by ``max_tokens`` (``length``) is passed on as such: it claims no validity.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from pipeline.errors import InvalidAnswer
from sampling.params import SamplingParams

__all__ = ["AnswerCheck", "AnswerGate", "GatedDelta", "resample_params"]

_SEED_MASK = (1 << 63) - 1


class AnswerCheck(Protocol):
    """What the gate needs of a compiled constraint's check (see ``stages.grammar.answer_check``)."""

    def check(self, text: str) -> Any:  # a Violation (with .path, .message, .reason) or None
        ...


class GatedDelta(Protocol):
    """What the gate reads of a delta (the handle's ``Delta``)."""

    @property
    def index(self) -> int: ...

    @property
    def finish_reason(self) -> str | None: ...


D = TypeVar("D", bound=GatedDelta)


@dataclass
class AnswerGate(Generic[D]):
    """Per request: which deltas may go out now, and which choices must be sampled again."""

    check: AnswerCheck
    backend: str
    is_streaming: bool
    counts: Counter[tuple[str, str, str]]  # (backend, "passed" | "failed", reason): the /metrics counter
    constraint_field: str | None = None  # the request field the constraint came from: the 422's param
    _held: dict[int, list[D]] = field(default_factory=dict)
    failed: dict[int, InvalidAnswer] = field(default_factory=dict)  # choice index -> why it failed

    def feed(self, delta: D, full_text: str) -> list[D]:
        """The deltas that may go out now; ``full_text`` is the choice's text including ``delta``.

        :raises InvalidAnswer: streaming, when the finished answer fails its check.
        """
        if delta.finish_reason is None:
            if self.is_streaming:
                return [delta]
            self._held.setdefault(delta.index, []).append(delta)
            return []
        held = self._held.pop(delta.index, [])
        if delta.finish_reason != "stop":
            return [*held, delta]  # length or error: nothing is claimed
        violation = self.verify(full_text)
        if violation is None:
            return [*held, delta]
        if self.is_streaming:
            raise violation
        self.failed[delta.index] = violation
        return []

    def verify(self, text: str) -> InvalidAnswer | None:
        """Check one finished answer, counting the result; the error to raise when it fails."""
        violation = self.check.check(text)
        if violation is None:
            self.counts[(self.backend, "passed", "")] += 1
            return None
        reason = getattr(violation, "reason", "") or "constraint"
        self.counts[(self.backend, "failed", reason)] += 1
        where = f" at {violation.path}" if violation.path else ""
        return InvalidAnswer(
            f"the answer does not satisfy the constraint{where}: {violation.message}",
            path=violation.path,
            reason=reason,
            field=self.constraint_field,
            stage="answer_check",
        )


def resample_params(params: SamplingParams, *, index: int, attempt: int) -> SamplingParams:
    """Sampling parameters for attempt ``attempt`` (1, 2, ...) at choice ``index``: one sequence,
    a seed derived from the request's (reproducible when the request has a seed). A greedy request
    samples at temperature 1: greedy again would write the same answer."""
    base = params.seed if params.seed is not None else 0
    seed = (base * 1_000_003 + index * 7_919 + attempt * 104_729) & _SEED_MASK
    if not params.is_greedy:
        return dataclasses.replace(params, n=1, seed=seed)
    return dataclasses.replace(params, n=1, seed=seed, temperature=1.0, top_k=0)
