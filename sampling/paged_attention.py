"""Attention over a paged KV cache, and its entry in transformers' ``AttentionInterface``.

A step's tokens are grouped ``[B, Tq]`` (decode: Tq = 1; prefill chunk: B = 1). Each new token's
K/V is written at its cache slot; each query row then attends to the keys of its own sequence,
gathered from the cache through that sequence's block table. Registered with transformers under
``ATTENTION_NAME``, the same function serves any model whose attention goes through the interface:
q, k and v arrive after the model's own projections, norms and RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_NAME", "AttentionBatch", "PagedStep", "attend", "image_span_ids", "register_paged_attention"]

ATTENTION_NAME = "paged_kv"


@dataclass(slots=True)
class AttentionBatch:
    """Where a step's tokens go in the cache and which keys each query sees.

    Queries are grouped ``[B, Tq]`` (decode: Tq = 1; prefill chunk: B = 1).
    """

    positions: torch.Tensor  # [B, Tq] cache index of each query token (its 1-D position)
    slot_mapping: torch.Tensor  # [B * Tq] flat cache slot each new token's K/V is written to
    key_slots: torch.Tensor  # [B, L] flat cache slots of every key a row may see (padded)
    key_valid: torch.Tensor  # [B, L] bool: slot holds a key of this sequence (not padding)
    # [B, L] the image span of each key position (-1: none), for a prefill chunk of a family whose
    # image tokens attend bidirectionally (Gemma 3); a span is whole inside one chunk (the scheduler)
    image_spans: torch.Tensor | None = None
    # the visibility mask of each sliding window (None: none), built by the first layer that needs
    # it and reused by the others: every layer of a step sees the same keys
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)
    # [3, B * Tq] the positions the model's RoPE takes where they are not the cache indices (M-RoPE:
    # temporal, height, width); None: ``positions``. Masks and slots stay on the cache indices.
    rope_positions: torch.Tensor | None = None

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[B, 1, Tq, L]``: a key is visible if it belongs to the row, is not in its future (or is
        in the query's own image span), and lies inside the window (transformers' rule for Gemma 3:
        window AND (causal OR same image), the window being key > query - window)."""
        mask = self.masks.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(self.key_slots.shape[1], device=self.key_slots.device)[None, None, :]
            query_pos = self.positions[:, :, None]
            mask = (key_pos <= query_pos) & self.key_valid[:, None, :]
            if self.image_spans is not None:
                query_span = self.image_spans.gather(1, self.positions)[:, :, None]  # [B, Tq, 1]
                mask |= (self.image_spans[:, None, :] == query_span) & (query_span >= 0)
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
            mask = self.masks[sliding_window] = mask[:, None]
        return mask


def image_span_ids(is_image: torch.Tensor, start: int) -> torch.Tensor:
    """``[1, start + len(is_image)]``: for the chunk at positions ``start...`` whose image
    placeholders are ``is_image``, the span each belongs to (runs of placeholders, numbered from 0),
    -1 elsewhere and before the chunk. What transformers builds from Gemma 3's ``token_type_ids``."""
    begins = is_image & ~F.pad(is_image, (1, 0))[:-1]
    spans = torch.where(is_image, begins.cumsum(0) - 1, -1)
    return F.pad(spans, (start, 0), value=-1)[None]


@dataclass(slots=True)
class PagedStep:
    """What the registered attention function needs of one forward: the batch and the caches."""

    batch: AttentionBatch
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_slots, kv_heads, head_dim] each


def attend(
    query: torch.Tensor,  # [B, H, Tq, D]
    key: torch.Tensor,  # [B * Tq, kv_heads, D] the step's new keys
    value: torch.Tensor,  # [B * Tq, kv_heads, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write the new K/V into the cache and attend; ``[B, H, Tq, D]``."""
    k_cache.index_copy_(0, batch.slot_mapping, key)
    v_cache.index_copy_(0, batch.slot_mapping, value)
    # keys, values: [B, kv_heads, L, D] gathered through the block tables
    keys = k_cache[batch.key_slots].transpose(1, 2)
    values = v_cache[batch.key_slots].transpose(1, 2)
    mask = batch.mask(sliding_window)
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    # soft-capped scores (Gemma 2): tanh before the mask, as transformers' eager attention does
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = query @ keys.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(query.dtype) @ values


def _paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D]: the step's N = B * Tq tokens as one row
    key: torch.Tensor,  # [1, kv_heads, N, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    paged_step: PagedStep | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature; returns ``[1, N, H, D]`` as its own functions do."""
    if paged_step is None:
        raise RuntimeError("paged attention called without a step: run the model through the paged runner")
    batch = paged_step.batch
    b, tq = batch.positions.shape
    k_cache, v_cache = paged_step.kv_caches[module.layer_idx]  # type: ignore[index]
    heads, dim = query.shape[1], query.shape[-1]
    # [1, H, B*Tq, D] -> [B, H, Tq, D]
    grouped = query[0].view(heads, b, tq, dim).transpose(0, 1)
    out = attend(
        grouped,
        key[0].transpose(0, 1),  # [B*Tq, kv_heads, D]
        value[0].transpose(0, 1),
        k_cache,
        v_cache,
        batch,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out.permute(0, 2, 1, 3).reshape(1, b * tq, heads, dim), None


def register_paged_attention() -> str:
    """Register the paged attention with transformers (idempotent); the name to select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
    return ATTENTION_NAME
