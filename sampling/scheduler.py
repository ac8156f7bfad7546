"""Continuous batching: which sequences run this step, KV blocks, preemption.

A step is either prefill chunks (one sequence's, or with ``max_prefill_seqs`` > 1 several sequences'
in one forward, ``PrefillBatch``) or one decode token for every running sequence. While sequences
decode, a prefill step runs once ``decode_steps_per_prefill`` decode steps have run since the last
one (1: they alternate), so a burst of prompts delays at most one decode token in that many (the
cadence TGI's router keeps with ``max_waiting_tokens``); never held when nothing decodes, waiting
sequences are admitted in order and none starves. A prefill step takes at most
``chunk_tokens_with_decodes`` tokens while sequences decode, ``chunk_tokens`` otherwise (a per-step
token budget, as vLLM's chunked prefill): a chunk that finishes its prompt leaves the rest of the
budget to the next waiting sequences, so a burst of short prompts (prefix-cache hits of a popular
image) costs a few steps beside the decodes, not one each, as vLLM v1 and SGLang schedule it. Only
a batch's last chunk may leave its prompt unfinished; a sequence that forks into n > 1 runs alone.
When KV blocks run out, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from its prompt plus what it had generated.

With the prefix cache on, a sequence admitted takes the longest run of cached blocks its tokens
hash to (sampling/prefix_cache.py) and starts its prefill after them; its full blocks are registered
as their K/V is computed. A preempted sequence finds its own blocks there when it comes back, unless
they were evicted meanwhile. n > 1 children share their parent's full blocks and copy only its last,
partial one.

For a family whose image tokens attend bidirectionally within their image (Gemma 3,
``atomic_image_spans``), an image span is never split across prefill chunks: a chunk that would end
inside a span ends at its start, or holds exactly the span when it starts there and the span is
longer than the budget; a cached prefix that ends inside a span is cut back to whole blocks before
it (sampling/image_spans.py).

``schedule_ahead()`` serves the engine's one-step-ahead loop: the next decode of the sequences whose
tokens are still in flight. It decides nothing that ``schedule()`` would decide otherwise; when a
prefill should run or room must be made, it declines and the loop finishes its in-flight step first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent import futures

from sampling.image_spans import chunk_end
from sampling.kv_cache import BlockAllocator, blocks_needed
from sampling.prefill_batching import batched_prefill
from sampling.prefix_cache import register_computed, take_cached_prefix
from sampling.sequence import SeqState, Sequence
from sampling.step_kinds import DecodeStep, PrefillBatch, PrefillStep, Schedule

__all__ = ["DecodeStep", "PrefillBatch", "PrefillStep", "Schedule", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        block_size: int,
        max_running: int,
        chunk_tokens: int,
        chunk_tokens_with_decodes: int | None = None,
        decode_steps_per_prefill: int = 1,
        prefix_caching: bool = False,
        image_token_id: int | None = None,
        atomic_image_spans: bool = False,
        max_prefill_seqs: int = 1,
        mixed_chunk_tokens: int = 0,
    ) -> None:
        if decode_steps_per_prefill < 1:
            raise ValueError(f"decode_steps_per_prefill must be at least 1, got {decode_steps_per_prefill}")
        if max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs must be at least 1, got {max_prefill_seqs}")
        self.max_prefill_seqs = max_prefill_seqs
        # decodes join a prefill step whose chunks are at most this long (0: never), in one forward
        self.mixed_chunk_tokens = mixed_chunk_tokens
        self.allocator = allocator
        self.prefix_caching = prefix_caching
        self.image_token_id = image_token_id
        # the image token whose spans are never split across chunks; None: spans may be split
        self.atomic_image_token = image_token_id if atomic_image_spans else None
        self.block_size = block_size
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        # a prefill chunk's budget while sequences decode; None: chunk_tokens
        self.chunk_tokens_with_decodes = min(chunk_tokens_with_decodes or chunk_tokens, chunk_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._unfit: list[Sequence] = []  # found by this schedule() call; handed back with its result
        self.decode_steps_per_prefill = decode_steps_per_prefill
        # decode steps since the last prefill step; a prefill may run beside decodes once it reaches
        # decode_steps_per_prefill (the first one at once)
        self._decodes_since_prefill = decode_steps_per_prefill
        self.num_preemptions = 0  # since start, for metrics

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        seq.block_table += self.allocator.allocate(self.blocks_for(seq, num_tokens))

    def release(self, seq: Sequence) -> None:
        """Free everything ``seq`` holds in the cache and forget it."""
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.matcher = None  # rebuilt by replaying output_ids when it runs again
        seq.state = SeqState.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _blocks_to_admit(self, seq: Sequence) -> int:
        # the whole prompt plus one decode token, and a block for each child it will fork into (its
        # copy of the last, partial block, or its first decode token's); cached blocks count as new
        return blocks_needed(seq.num_tokens + 1, self.block_size) + self._num_copies(seq) - 1

    def admit(self) -> Sequence | None:
        if not self.waiting or len(self.running) >= self.max_running:
            return None
        seq = self.waiting[0]
        need = self._blocks_to_admit(seq)
        if need > self.allocator.num_blocks:  # waiting would never help
            self._unfit.append(self.waiting.popleft())
            return self.admit()
        if need > self.allocator.num_free:
            return None
        self.waiting.popleft()
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        if self.prefix_caching:
            self._take_cached_prefix(seq)
        return seq

    def _take_cached_prefix(self, seq: Sequence) -> None:
        take_cached_prefix(self.allocator, seq, self.block_size, self.image_token_id, self.atomic_image_token)

    def cache_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V is computed (and whose tokens are committed)."""
        if self.prefix_caching:
            register_computed(self.allocator, seq, self.block_size, self.image_token_id)

    def schedule(self) -> Schedule:
        """The next step, and the sequences found unfit on the way."""
        step = self._next_step()
        unfit, self._unfit = self._unfit, []
        return Schedule(step, unfit)

    def schedule_ahead(self, keep: Callable[[Sequence], bool]) -> DecodeStep | None:
        """The decode step after the one in flight: every running sequence with a token in flight that
        ``keep`` keeps, its blocks grown for that token's K/V. None when only ``schedule()`` can decide
        (a prefill to run, a sequence to fail, room to make by preempting, nothing to decode)."""
        decoding = [s for s in self.running if not s.is_prefilling]
        if self._would_prefill(len(decoding)) or any(s.num_in_flight == 0 for s in decoding):
            return None
        seqs = [s for s in decoding if keep(s)]
        if not seqs or sum(self.blocks_for(s, s.num_tokens_launched) for s in seqs) > self.allocator.num_free:
            return None
        for seq in seqs:
            self.grow(seq, seq.num_tokens_launched)
        self._decodes_since_prefill += 1
        return DecodeStep(seqs)

    def _would_prefill(self, num_decoding: int) -> bool:
        """Whether ``schedule()`` would now run a prefill chunk or fail a sequence that can never fit
        (after a decode step, whose ``num_decoding`` running sequences still decode)."""
        if not self._prefill_due(num_decoding > 0):
            return False
        if any(s.is_prefilling and not s.held_for_grammar for s in self.running):  # a prefill goes on
            return True
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        need = self._blocks_to_admit(self.waiting[0])
        return need <= self.allocator.num_free or need > self.allocator.num_blocks

    def _next_step(self) -> PrefillStep | PrefillBatch | DecodeStep | None:
        prefilling = next(
            (s for s in self.running if s.is_prefilling and not s.is_extending and not s.held_for_grammar), None
        )
        decoding = [s for s in self.running if not s.is_prefilling or s.is_extending]
        want_prefill = prefilling is not None or bool(self.waiting)
        if want_prefill and self._prefill_due(bool(decoding)):
            seq = prefilling or self.admit()
            if seq is not None and not seq.held_for_grammar:
                start = seq.num_computed
                budget = self.chunk_tokens_with_decodes if decoding else self.chunk_tokens
                end = self.chunk_end(seq, start, budget)
                if self._reserve(seq, end):
                    self.grow(seq, end)
                    self._decodes_since_prefill = 0
                    return batched_prefill(self, PrefillStep(seq, start, end), budget)
                decoding = [s for s in self.running if not s.is_prefilling or s.is_extending]
        if not decoding:
            return None
        step = self._schedule_decode(decoding)
        if step is None:
            return None
        self._decodes_since_prefill += 1
        return self._with_extends(step)

    @staticmethod
    def _with_extends(step: DecodeStep) -> DecodeStep | PrefillBatch:
        """``step``, where some of its sequences run forced tokens: one forward with each of those as
        a chunk of its uncomputed tokens, beside the others' decodes (their blocks grown already)."""
        extending = [s for s in step.seqs if s.is_extending]
        if not extending:
            return step
        chunks = [PrefillStep(s, s.num_computed, s.num_tokens) for s in extending]
        return PrefillBatch(chunks, [s for s in step.seqs if not s.is_extending], extends=True)

    def await_grammars(self, timeout: float) -> None:
        """Nothing can run but sequences held for their grammars' compiles: wait for the first compile
        to end, ``timeout`` seconds at most (so a command arriving meanwhile waits no longer), rather
        than spin the step loop."""
        compiles = [s.grammar for s in self.running if s.held_for_grammar and isinstance(s.grammar, futures.Future)]
        if compiles:
            futures.wait(compiles, timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def note_mixed_step(self) -> None:
        """A prefill step ran the decodes too: it counts as a decode step for the cadence."""
        self._decodes_since_prefill = 1

    def _prefill_due(self, decoding: bool) -> bool:
        """Whether a prefill chunk may run this step: always when nothing decodes, and beside decodes
        once ``decode_steps_per_prefill`` decode steps have run since the last one."""
        return not decoding or self._decodes_since_prefill >= self.decode_steps_per_prefill

    def chunk_end(self, seq: Sequence, start: int, budget: int) -> int:
        """Where the prefill chunk starting at ``start`` ends: ``budget`` tokens later at most, and
        with ``atomic_image_spans`` never inside an image span (sampling/image_spans.py)."""
        end = min(seq.num_tokens, start + budget)
        image = self.atomic_image_token
        return end if image is None else chunk_end(seq.prompt_ids, image, start, end)

    @staticmethod
    def _num_copies(seq: Sequence) -> int:
        """How many copies of its blocks ``seq`` will hold: n until it has forked, then 1."""
        return 1 if seq.has_forked else seq.num_siblings

    def _reserve(self, seq: Sequence, end: int) -> bool:
        """Make room for the prefill chunk ending at ``end`` (and, on the last chunk, for the children
        it forks into), preempting the newest running sequences. Decodes that grew since ``seq`` was
        admitted may have taken its room: then it may be the one preempted (False)."""
        need = self.blocks_for(seq, end)
        if end == seq.num_tokens:  # each child copies the last block if it is partial
            need += (self._num_copies(seq) - 1) * (blocks_needed(end, self.block_size) - end // self.block_size)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_decode(self, decoding: list[Sequence]) -> DecodeStep | None:
        for seq in list(decoding):
            if seq not in decoding:
                continue  # preempted to make room for an older one
            while self.blocks_for(seq, seq.num_tokens) > self.allocator.num_free:
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:  # alone and still out of room
                    self.release(seq)
                    self._unfit.append(seq)
                    decoding.remove(seq)
                    break
                self._preempt(victim)
                if victim in decoding:
                    decoding.remove(victim)
                if victim is seq:
                    break
            if seq in decoding:
                self.grow(seq, seq.num_tokens)
        return DecodeStep(decoding) if decoding else None

    def fork(self, parent: Sequence, child: Sequence) -> tuple[list[int], list[int]]:
        """Give ``child`` the prefilled ``parent``'s blocks: its full ones shared, its partial last one
        copied; the blocks whose K/V the caller must copy, and where to."""
        num_full = parent.num_computed // self.block_size
        shared = parent.block_table[:num_full]
        self.allocator.share(shared)
        copied = self.allocator.allocate(len(parent.block_table) - num_full)
        child.block_table = shared + copied
        child.num_computed = parent.num_computed
        child.num_registered = min(parent.num_registered, num_full * self.block_size)
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_image_rows = parent.num_hashed_image_rows
        child.is_chain_broken = parent.is_chain_broken
        child.state = SeqState.RUNNING
        self.running.append(child)
        return parent.block_table[num_full:], copied
