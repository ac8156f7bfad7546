"""LLMEngine: continuous batching with guided sampling; ``step()`` reads as its verbs, schedule and run.

The engine assembles its parts and owns nothing of a step itself: the scheduler decides what runs,
the request table holds the sequences (sampling/request_table.py), and ``StepParts``
(sampling/step.py) is the step: launch the forward with the bitmask fill beside it, sample, commit,
record. Two decode loops drive those parts: the synchronous one here (``schedule()``, then ``run()``),
and, with ``one_step_ahead``, ``OneStepAhead`` (sampling/ahead.py), which launches the next decode's
forward before the last step's tokens are committed and commits them while it runs. The loops share
the parts, never each other's state: this module imports ahead.py, which knows only step.py.

Threads: drive the engine from one thread. Every torch op of a step runs on that thread (one step
ahead: on the loop's device thread); the fill thread runs only the grammar backends (sampling/step.py
says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sampling.ahead import OneStepAhead
from sampling.decode_buffers import DecodeBuffers
from sampling.detokenizer import TokenBytes
from sampling.guided.decoder import GuidedDecoder
from sampling.guided.forced import ForcedTokens
from sampling.inputs import EngineInput, SeqOutput
from sampling.kv_cache import BlockAllocator
from sampling.masked_sampler import MaskedSampler
from sampling.model_runner import ModelRunner
from sampling.params import MAX_N
from sampling.request_table import RequestTable
from sampling.scheduler import Scheduler
from sampling.step import StepParts
from sampling.timeline import StepTiming

__all__ = ["LLMEngine", "StepTiming"]


class LLMEngine:
    """Synchronous engine core; drive it from one thread with ``add``, ``abort`` and ``step``."""

    def __init__(
        self,
        runner: ModelRunner,
        token_bytes: TokenBytes,
        *,
        eos_token_ids: list[int],
        num_blocks: int,
        max_running: int = 32,
        chunk_tokens: int = 2048,
        chunk_tokens_with_decodes: int | None = None,
        decode_steps_per_prefill: int = 1,
        max_prefill_seqs: int = 1,
        mixed_chunk_tokens: int = 0,
        record_timeline: bool = False,
        tracer: Any = None,
        one_step_ahead: bool = False,
        prefix_caching: bool = True,
        lazy_mask: bool = True,
        encode: Callable[[str], list[int]] | None = None,
        forced_tokens: bool = False,
        decode_buffers: bool = False,
    ) -> None:
        """``forced_tokens``: write what a grammar forces without a step per token
        (sampling/guided/forced.py); ``encode``: text to token ids without special tokens, which
        xgrammar's forced text needs (without it, only llguidance's matchers force);
        ``decode_buffers``: decode steps read their inputs from tensors allocated once, padded to
        buckets (sampling/decode_buffers.py)."""
        if num_blocks > runner.pad_block:  # the pad block (and past it) is not the sequences' to hold
            raise ValueError(f"{num_blocks} KV blocks for sequences; the runner's cache holds {runner.pad_block}")
        self.runner = runner
        self.token_bytes = token_bytes
        # the most sequences one step may hold: every running one, the last admitted forked into its n
        self.max_rows = max_running - 1 + max(MAX_N, 2)
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            block_size=runner.block_size,
            max_running=max_running,
            chunk_tokens=chunk_tokens,
            chunk_tokens_with_decodes=chunk_tokens_with_decodes,
            decode_steps_per_prefill=decode_steps_per_prefill,
            max_prefill_seqs=max_prefill_seqs,
            mixed_chunk_tokens=mixed_chunk_tokens,
            prefix_caching=prefix_caching,
            image_token_id=runner.image_token_id,
            atomic_image_spans=runner.atomic_image_spans,
        )
        self.requests = RequestTable(
            self.scheduler,
            token_bytes,
            eos_token_ids=eos_token_ids,
            max_model_len=runner.max_model_len,
            device=runner.device,
        )
        # lazy_mask: greedy rows whose choice the grammar allows skip the mask (exact; sampling/masked_sampler.py)
        guided = GuidedDecoder(runner.cfg.vocab_size, self.max_rows, runner.device)
        sampler = MaskedSampler(guided, eos_token_ids, lazy_mask=lazy_mask)
        self.parts = StepParts(
            runner,
            self.scheduler,
            self.requests,
            sampler,
            max_rows=self.max_rows,
            record_timeline=record_timeline,
            tracer=tracer,
            forced=ForcedTokens(token_bytes.table, encode, eos_token_ids) if forced_tokens else None,
            buffers=DecodeBuffers(
                max_rows=self.max_rows,
                max_model_len=runner.max_model_len,
                block_size=runner.block_size,
                pad_block=runner.pad_block,
                device=runner.device,
            )
            if decode_buffers
            else None,
        )
        # the decode loop one step ahead; None: the synchronous loop
        self.ahead = OneStepAhead(self.parts) if one_step_ahead else None

    @property
    def timeline(self) -> list[StepTiming]:
        """The timing of every step so far (with ``record_timeline``)."""
        return self.parts.timeline

    def add(self, inp: EngineInput) -> None:
        """Queue a request; its ``n`` sequences share one prefill.

        :raises ValueError: its images are pixels still (this engine encodes none: the engine process's
            ``EngineImages`` turns them into embeddings first), or it asks for more than ``MAX_N`` sequences."""
        if inp.image_pixels:
            raise ValueError(f"request {inp.request_id}: its images are not encoded (no vision encoder here)")
        if not 1 <= inp.sampling.n <= MAX_N:
            raise ValueError(f"request {inp.request_id}: n must be 1 to {MAX_N}, got {inp.sampling.n}")
        self.requests.add(inp)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its slots, blocks and matchers now."""
        self.requests.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.ahead is not None and self.ahead.in_flight is not None)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @torch.inference_mode()
    def step(self) -> list[SeqOutput]:
        """Run one scheduled step; the outputs of every sequence that produced a token (one step ahead:
        of the step before the one it launches)."""
        if self.ahead is not None:
            return self.ahead.step()
        scheduled, refused = self.parts.schedule()
        return refused + (self.parts.run(scheduled) if scheduled is not None else [])
