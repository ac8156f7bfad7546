"""Which chunks share a prefill step's forward: the next waiting sequences' (``max_prefill_seqs``),
and the running decodes when the chunks are short (``mixed_chunk_tokens``: a mixed step, as vLLM v1
schedules decodes and prefill chunks under one token budget).

A mixed step's prefill tokens are at most ``mixed_chunk_tokens`` (and the chunk budget): each of its
decodes waits for the whole forward, so a burst of short prompts adds a little to many decode
tokens, where a batch under the full budget would add a lot to a few. A chunk that forks into n > 1
runs alone, and decodes join only when their blocks are free without preempting.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Protocol

from sampling.kv_cache import BlockAllocator
from sampling.sequence import Sequence
from sampling.step_kinds import PrefillBatch, PrefillStep

__all__ = ["PrefillScheduler", "batched_prefill"]


class PrefillScheduler(Protocol):
    """What batching asks of the scheduler that calls it (``sampling.scheduler.Scheduler``): named
    here, so that this module needs no import of the scheduler, which imports it."""

    running: list[Sequence]
    waiting: deque[Sequence]
    allocator: BlockAllocator
    max_prefill_seqs: int
    mixed_chunk_tokens: int

    def admit(self) -> Sequence | None: ...
    def blocks_for(self, seq: Sequence, num_tokens: int) -> int: ...
    def grow(self, seq: Sequence, num_tokens: int) -> None: ...
    def chunk_end(self, seq: Sequence, start: int, budget: int) -> int: ...
    def note_mixed_step(self) -> None: ...


def batched_prefill(sched: PrefillScheduler, first: PrefillStep, budget: int) -> PrefillStep | PrefillBatch:
    """The prefill step starting with ``first`` (scheduled already), the step's budget ``budget`` tokens."""
    length = first.end - first.start
    decoding = [s for s in sched.running if not s.is_prefilling and s is not first.seq]
    mixing = bool(decoding) and length <= sched.mixed_chunk_tokens and _batchable(sched, first.seq, alone=True)
    if mixing:
        budget = min(budget, sched.mixed_chunk_tokens)
    more = _more_chunks(sched, budget - length) if first.is_last_chunk and _batchable(sched, first.seq) else []
    chunks = [first, *more]
    if mixing:
        # not a sequence with a chunk here: a replay admitted with all but its last token cached is
        # not prefilling, yet its last token is its chunk
        prefilled = {id(c.seq) for c in chunks}
        decoding = [s for s in sched.running if not s.is_prefilling and id(s) not in prefilled]
        if decoding and sum(sched.blocks_for(s, s.num_tokens) for s in decoding) <= sched.allocator.num_free:
            for seq in decoding:
                sched.grow(seq, seq.num_tokens)
            sched.note_mixed_step()
            return PrefillBatch(chunks, decoding)
    return first if not more else PrefillBatch(chunks)


def _batchable(sched: PrefillScheduler, seq: Sequence, alone: bool = False) -> bool:
    """Whether ``seq``'s chunk may share a forward: not when it forks into n > 1 after it (its
    children copy its K/V and logits row by row), nor before its first sample when its grammar came
    compiling (a compile that failed fails the step it samples in, and one still running defers its
    sample: either must concern it alone);
    ``alone``: with decodes, not other chunks."""
    compiled_apart = isinstance(seq.grammar, Future)
    return (alone or sched.max_prefill_seqs > 1) and (seq.num_siblings == 1 or seq.has_forked) and not compiled_apart


def _more_chunks(sched: PrefillScheduler, budget: int) -> list[PrefillStep]:
    """The chunks of the next waiting sequences that join a prefill step with ``budget`` tokens left,
    admitted in order; a sequence admitted whose chunk cannot join (over the budget, or its blocks
    not free without preempting) prefills in a later step."""
    chunks: list[PrefillStep] = []
    while budget > 0 and len(chunks) + 1 < sched.max_prefill_seqs and sched.waiting:
        if not _batchable(sched, sched.waiting[0]):
            break
        seq = sched.admit()
        if seq is None:
            break
        start = seq.num_computed
        end = sched.chunk_end(seq, start, budget)
        if not start < end <= start + budget or sched.blocks_for(seq, end) > sched.allocator.num_free:
            break
        sched.grow(seq, end)
        chunks.append(PrefillStep(seq, start, end))
        budget -= end - start
        if end < seq.num_tokens:  # its prompt goes on next step: the batch ends with it
            break
    return chunks
