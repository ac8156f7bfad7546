"""A prefill step's forward: one sequence's chunk (``runner.prefill``) or several (``runner.prefill_batch``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from sampling.paged_runner import PagedRunner, PrefillChunk
from sampling.sequence import Sequence
from sampling.step_kinds import PrefillBatch, PrefillStep

__all__ = ["chunk_input", "prefill_forward"]


def chunk_input(seq: Sequence, start: int, end: int, image_token_id: int | None) -> PrefillChunk:
    """The runner's inputs for the chunk ``[start, end)`` of ``seq``: its tokens, image rows, M-RoPE
    positions and extra inputs (DeepStack) sliced to the chunk, where the sequence has them."""
    return PrefillChunk(
        seq.tokens(start, end),
        start,
        seq.block_table,
        seq.image_rows(start, end, image_token_id),
        # a replay after a preemption runs past the prompt: its generated tokens are no image placeholders
        num_prompt_tokens=len(seq.prompt_ids) - start,
        rope_positions=seq.rope_positions(start, end),
        extra_inputs=seq.extra_rows(start, end, image_token_id),
    )


def prefill_forward(runner: PagedRunner, step: PrefillStep | PrefillBatch) -> Callable[[], torch.Tensor]:
    """The step's forward: logits ``[S, vocab]`` of its decodes' tokens, then of the last token of each
    of its chunks that end their sequence's prompt (a lone chunk's row even when it does not)."""
    if isinstance(step, PrefillStep):
        chunk = chunk_input(step.seq, step.start, step.end, runner.image_token_id)
        extra: dict[str, Any] = {"num_prompt_tokens": chunk.num_prompt_tokens}
        if chunk.rope_positions is not None:
            extra["rope_positions"] = chunk.rope_positions
        if chunk.extra_inputs:
            extra["extra_inputs"] = chunk.extra_inputs
        return functools.partial(
            runner.prefill, chunk.token_ids, chunk.start, chunk.block_table, chunk.image_rows, **extra
        )
    # a decode is a chunk of one token: its last, at its position (past the prompt: text, M-RoPE delta)
    decodes = [chunk_input(s, s.num_tokens - 1, s.num_tokens, runner.image_token_id) for s in step.decodes]
    chunks = decodes + [chunk_input(c.seq, c.start, c.end, runner.image_token_id) for c in step.chunks]
    sampled = list(range(len(decodes))) + [len(decodes) + i for i, c in enumerate(step.chunks) if c.is_last_chunk]

    def forward() -> torch.Tensor:
        logits = runner.prefill_batch(chunks)
        return logits if len(sampled) == len(chunks) else logits[sampled]

    return forward
