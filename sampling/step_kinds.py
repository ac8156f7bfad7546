"""What the scheduler decides a step runs: one prefill chunk, several sequences' chunks, or a decode."""

from __future__ import annotations

from dataclasses import dataclass, field

from sampling.sequence import Sequence

__all__ = ["DecodeStep", "PrefillBatch", "PrefillStep", "Schedule"]


@dataclass(slots=True)
class PrefillStep:
    """The chunk ``[start, end)`` of one sequence's prompt (and, on a replay, its generated tokens)."""

    seq: Sequence
    start: int
    end: int

    @property
    def is_last_chunk(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass(slots=True)
class PrefillBatch:
    """One chunk of each of several sequences in one forward (a burst of short prompts, such as
    prefix-cache hits): every chunk but the last one is its sequence's last. With ``decodes``, the
    same forward also runs the next token of each of those sequences (a mixed step)."""

    chunks: list[PrefillStep]
    decodes: list[Sequence] = field(default_factory=list)
    # its chunks are forced tokens (Sequence.is_extending), its decodes every other running sequence:
    # a decode step in all but name, where some sequences run several tokens
    extends: bool = False

    @property
    def seqs(self) -> list[Sequence]:
        return [*self.decodes, *(c.seq for c in self.chunks)]


@dataclass(slots=True)
class DecodeStep:
    seqs: list[Sequence]


@dataclass(slots=True)
class Schedule:
    """What ``schedule()`` decided: the step to run (None: nothing can run now), and the sequences
    that can never fit in the cache, released already, for the engine to fail."""

    step: PrefillStep | PrefillBatch | DecodeStep | None
    unfit: list[Sequence]
