"""One generated sequence and its state; only the scheduler changes ``state``."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from sampling.detokenizer import Detokenizer
from sampling.inputs import ImageKey
from sampling.params import SamplingParams
from sampling.stop import StopChecker
from vision.mrope import MRopePositions

__all__ = ["SeqState", "Sequence"]


class SeqState(enum.Enum):
    WAITING = "waiting"  # not in the KV cache (new, or preempted and waiting for recompute)
    RUNNING = "running"  # has KV blocks; prefilling (num_computed < len - 1) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # choice index within its request (n > 1)
    prompt_ids: list[int]
    image_embeds: torch.Tensor | None
    params: SamplingParams
    grammar: Any | None
    detokenizer: Detokenizer
    generator: torch.Generator | None
    stop: StopChecker
    num_siblings: int = 1  # n: this sequence forks into n after its prefill
    grammar_trigger: int | None = None  # the grammar starts after this token (see EngineInput)
    grammar_start: int | None = 0  # index in output_ids where the grammar starts; None: not triggered yet
    # while set, the sequence is reasoning: its answer (and grammar, and trigger) starts after this token
    reasoning_end: int | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    matcher: Any | None = None  # xgrammar.GrammarMatcher, rebuilt after a preemption
    state: SeqState = SeqState.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    has_forked: bool = False  # its n - 1 siblings exist
    # tokens sampled (or being sampled) on the device and not yet committed: 0 in the synchronous loop,
    # 1 between steps in the one-step-ahead loop (see sampling/ahead.py)
    num_in_flight: int = 0
    # the prefix cache (sampling/prefix_cache.py): the prompt's images by content, the keys of its
    # full blocks so far, the image rows those blocks hold, and how many of its blocks are registered
    image_keys: list[ImageKey] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_image_rows: int = 0
    is_chain_broken: bool = False
    num_registered: int = 0
    # M-RoPE positions of the prompt (None: 1-D), and per-image-token prefill inputs (EngineInput)
    mrope: MRopePositions | None = None
    extra_prefill: dict[str, torch.Tensor] = field(default_factory=dict)
    _distinct_prompt: torch.Tensor | None = field(default=None, init=False, repr=False)

    def distinct_prompt_ids(self) -> torch.Tensor:
        """The prompt's token ids, each once (CPU int64): built on first use, as the repetition
        penalty reads them at every step and the prompt never changes."""
        if self._distinct_prompt is None:
            self._distinct_prompt = torch.unique(torch.tensor(self.prompt_ids, dtype=torch.long))
        return self._distinct_prompt

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens_launched(self) -> int:
        """Tokens the device has or will have: the committed ones and those in flight."""
        return self.num_tokens + self.num_in_flight

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def is_prefilling(self) -> bool:
        """True until every token but the last sampled one has its K/V in the cache."""
        return self.num_computed < self.num_tokens - (1 if self.output_ids else 0)

    @property
    def owes_answer(self) -> bool:
        """Reasoning still, with a constraint its answer must meet: no end of sequence until the
        reasoning ends (an answer that never began cannot be a constrained one)."""
        return self.reasoning_end is not None and self.grammar is not None

    @property
    def must_end_reasoning(self) -> bool:
        """Reasoning still, with its ``max_reasoning_tokens`` spent: its next token is the end tag."""
        bound = self.params.max_reasoning_tokens
        return self.reasoning_end is not None and bound is not None and len(self.output_ids) >= bound

    @property
    def is_extending(self) -> bool:
        """Its prompt computed, with more than its last token still to run: forced tokens
        (sampling/guided/forced.py), which its next step runs as one extend before it samples."""
        return bool(self.output_ids) and self.num_computed >= len(self.prompt_ids) and self.is_prefilling

    @property
    def grammar_compiling(self) -> bool:
        """Whether its grammar is still compiling (a ``Future``: its request entered the engine
        first, pipeline/core/grammar_overlap.py); it cannot sample until the compile ends."""
        return isinstance(self.grammar, Future) and not self.grammar.done()

    @property
    def held_for_grammar(self) -> bool:
        """Prefilled but for the token that samples, whose chunk waits for the grammar's compile."""
        return self.grammar_compiling and self.num_computed >= self.num_tokens - 1

    def image_rows(self, start: int, end: int, image_token_id: int | None) -> torch.Tensor | None:
        """Embedding rows of the prompt's image tokens that fall in positions ``[start, end)``."""
        if self.image_embeds is None or image_token_id is None or start >= len(self.prompt_ids):
            return None
        return self.image_embeds[self._image_span(start, end, image_token_id)]

    def extra_rows(self, start: int, end: int, image_token_id: int | None) -> dict[str, torch.Tensor]:
        """The rows of each extra prefill input for the image tokens in ``[start, end)``."""
        if not self.extra_prefill or image_token_id is None or start >= len(self.prompt_ids):
            return {}
        span = self._image_span(start, end, image_token_id)
        return {name: rows[span] for name, rows in self.extra_prefill.items()}

    def _image_span(self, start: int, end: int, image_token_id: int) -> slice:
        before = sum(1 for t in self.prompt_ids[:start] if t == image_token_id)
        inside = sum(1 for t in self.prompt_ids[start:end] if t == image_token_id)
        return slice(before, before + inside)

    @property
    def rope_delta(self) -> int:
        """The offset of the model's RoPE position past the prompt (M-RoPE), else 0."""
        return self.mrope.delta if self.mrope is not None else 0

    def rope_positions(self, start: int, end: int) -> torch.Tensor | None:
        """``[3, end - start]`` M-RoPE positions of ``[start, end)`` (past the prompt: the 1-D index
        plus the delta on every row, as on a replay after a preemption); None for 1-D positions."""
        if self.mrope is None:
            return None
        prompt = self.mrope.positions[:, start:end]
        first = max(start, len(self.prompt_ids))
        past = torch.arange(first, max(first, end)) + self.mrope.delta
        return torch.cat([prompt, past.expand(3, -1)], dim=1)
