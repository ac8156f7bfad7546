"""Attention over a paged KV cache, and its entry in transformers' ``AttentionInterface``.

A step's tokens are grouped ``[B, Tq]`` (decode: Tq = 1; prefill chunk: B = 1; several prefill
chunks of one step: B chunks padded to the longest, their N tokens placed by ``query_index``). Each new token's
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

__all__ = [
    "ATTENTION_NAME",
    "AttentionBatch",
    "PagedStep",
    "attend",
    "attend_tokens",
    "image_span_ids",
    "paged_attention",
    "register_paged_attention",
]

ATTENTION_NAME = "paged_kv"


@dataclass(slots=True)
class AttentionBatch:
    """Where a step's tokens go in the cache and which keys each query sees.

    Queries are grouped ``[B, Tq]`` (decode: Tq = 1; prefill chunk: B = 1). The step's tokens are
    the N = B * Tq cells in order, or with ``query_index`` the N cells it names (ragged rows: the rest
    is padding, which no per-token layer ever sees).
    """

    positions: torch.Tensor  # [B, Tq] cache index of each query token (its 1-D position; padding: 0)
    slot_mapping: torch.Tensor  # [N] flat cache slot each of the step's tokens writes its K/V to
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
    # [N] the cell of ``[B * Tq]`` each of the step's tokens occupies; None: all of them, in order
    query_index: torch.Tensor | None = None

    def token_positions(self) -> torch.Tensor:
        """``[N]`` the 1-D position of each of the step's tokens."""
        flat = self.positions.reshape(-1)
        return flat if self.query_index is None else flat[self.query_index]

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
    """Write the new K/V into the cache and attend; ``[B, H, Tq, D]``.

    Under ``torch.compile`` this is one opaque operator (``paged_attention``): the compiler fuses
    what lies between attention calls and neither traces into it nor breaks the graph around it."""
    mask = batch.mask(sliding_window)
    if torch.compiler.is_compiling():
        return paged_attention(
            query, key, value, k_cache, v_cache, batch.slot_mapping, batch.key_slots, mask, scaling, softcap
        )
    return _attend_masked(
        query, key, value, k_cache, v_cache, batch.slot_mapping, batch.key_slots, mask, scaling, softcap
    )


def _attend_masked(
    query: torch.Tensor,  # [B, H, Tq, D]
    key: torch.Tensor,  # [N, kv_heads, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N]
    key_slots: torch.Tensor,  # [B, L]
    mask: torch.Tensor,  # [B, 1, Tq, L] bool
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)
    # keys, values: [B, kv_heads, L, D] gathered through the block tables (index_select: on the CPU
    # a third of the time of indexing with the [B, L] tensor, which goes through the general index kernel)
    slots, gathered = key_slots.reshape(-1), (*key_slots.shape, *k_cache.shape[1:])
    keys = k_cache.index_select(0, slots).view(gathered).transpose(1, 2)
    values = v_cache.index_select(0, slots).view(gathered).transpose(1, 2)
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    # soft-capped scores (Gemma 2): tanh before the mask, as transformers' eager attention does
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = query @ keys.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(query.dtype) @ values


@torch.library.custom_op("vlm_pipeline::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_slots: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """``attend`` with its mask built, as one operator: writes the new K/V into the caches; ``[B, H, Tq, D]``
    contiguous (the shape and strides its fake implementation promises the compiler)."""
    out = _attend_masked(query, key, value, k_cache, v_cache, slot_mapping, key_slots, mask, scaling, softcap)
    return out.contiguous()


@paged_attention.register_fake
def _(query: torch.Tensor, *_: Any) -> torch.Tensor:
    return query.new_empty(query.shape)


def attend_tokens(
    query: torch.Tensor,  # [N, H, D] the step's tokens
    key: torch.Tensor,  # [N, kv_heads, D]
    value: torch.Tensor,  # [N, kv_heads, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    **kwargs: Any,
) -> torch.Tensor:
    """``attend`` over the step's tokens as one row: grouped into ``[B, Tq]`` and back; ``[N, H, D]``."""
    b, tq = batch.positions.shape
    heads, dim = query.shape[1], query.shape[2]
    if batch.query_index is None:
        grouped = query.view(b, tq, heads, dim).transpose(1, 2)
    else:  # padding queries are zeros at position 0: they see key 0 of their row, so no row is all -inf
        grid = query.new_zeros(b * tq, heads, dim).index_copy_(0, batch.query_index, query)
        grouped = grid.view(b, tq, heads, dim).transpose(1, 2)
    out = attend(grouped, key, value, k_cache, v_cache, batch, **kwargs).transpose(1, 2).reshape(b * tq, heads, dim)
    return out if batch.query_index is None else out[batch.query_index]


def _paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D]: the step's N tokens as one row
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
    k_cache, v_cache = paged_step.kv_caches[module.layer_idx]  # type: ignore[index]
    out = attend_tokens(
        query[0].transpose(0, 1),  # [N, H, D]
        key[0].transpose(0, 1),  # [N, kv_heads, D]
        value[0].transpose(0, 1),
        k_cache,
        v_cache,
        paged_step.batch,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out[None], None


def register_paged_attention() -> str:
    """Register the paged attention with transformers (idempotent); the name to select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)
    return ATTENTION_NAME
