"""What every model runner shares: the paged KV cache, slot arithmetic, decode batches, block copies.

A runner owns the weights and the KV cache; the engine calls ``prefill`` (one chunk of one
sequence), ``prefill_batch`` (one chunk of each of several sequences in one forward: their tokens
as one row, grouped for attention into ``[B, Tq]`` padded rows), ``decode_inputs`` + ``decode``
(one token for each of B sequences) and ``copy_blocks``.
Every call is synchronous and runs on ``device``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sampling.kv_cache import allocate_kv_caches
from sampling.paged_attention import AttentionBatch, image_span_ids
from vision.checkpoint import Checkpoint

__all__ = ["ModelShape", "PagedRunner", "PrefillChunk"]


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill chunk in a batched prefill step: the arguments ``prefill`` takes."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    image_rows: torch.Tensor | None  # [image tokens in the chunk, hidden]
    num_prompt_tokens: int | None = None  # how many of ``token_ids`` are the prompt's (``image_mask``)
    rope_positions: torch.Tensor | None = None  # [3, len(token_ids)] M-RoPE positions; None: 1-D
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # per image token (DeepStack)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a language model the engine and the KV cache need."""

    vocab_size: int  # logits width
    hidden_size: int  # embedding width (image rows have it)
    num_layers: int
    num_kv_heads: int
    head_dim: int


class PagedRunner:
    """The KV cache and the step inputs of a runner; subclasses add the model and its forward."""

    cfg: ModelShape
    model: torch.nn.Module  # the model it runs (the adapter: transformers' whole model, vision tower included)
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # the model's token embedding

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        device: str,
        max_model_len: int,
        block_size: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.image_token_id = checkpoint.image_token_id
        # the model's image tokens attend bidirectionally within their image (the registry sets it)
        self.atomic_image_spans = False
        self.device = torch.device(device)
        # the weights' and the KV cache's (logits are fp32 whatever it is); None: bf16 on CUDA, fp32 elsewhere
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pad_block = -1  # the block past the sequences' (``_allocate``)
        # the decode forward compiled (``compile_decode``); None: eager
        self.compiled_decode: Callable[[torch.Tensor, AttentionBatch], torch.Tensor] | None = None

    def _allocate(self, num_blocks: int) -> None:
        """The KV cache: ``num_blocks`` blocks for sequences and one more, the pad block, which no
        sequence is given: padding rows (sampling/decode_buffers.py) and warm-up steps write there."""
        cfg = self.cfg
        self.pad_block = num_blocks
        self.kv_caches = allocate_kv_caches(
            cfg.num_layers,
            num_blocks + 1,
            self.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            device=self.device,
            dtype=self.dtype,
        )

    def image_mask(self, token_ids: torch.Tensor, num_prompt_tokens: int | None) -> torch.Tensor:
        """``[T]`` which tokens of a prefill chunk are image placeholders: the prompt's image tokens,
        the chunk's first ``num_prompt_tokens`` (None: all of it is prompt). An image token the model
        generated (replayed after a preemption) is text, embedded as its token, as the decode step
        that produced it did and as transformers' decode steps do; vLLM places images by prompt
        position, not by token id, for the same reason."""
        if self.image_token_id is None:
            return torch.zeros_like(token_ids, dtype=torch.bool)
        is_image = token_ids == self.image_token_id
        if num_prompt_tokens is not None:
            is_image[max(num_prompt_tokens, 0) :] = False
        return is_image

    def chunk_image_mask(
        self, token_ids: torch.Tensor, num_prompt_tokens: int | None, image_rows: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``image_mask`` of a prefill chunk that carries image rows; None for one without (text only,
        or past its images): nothing reads the mask there, so a text prefill builds none."""
        if image_rows is None or not image_rows.numel():
            return None
        return self.image_mask(token_ids, num_prompt_tokens)

    def _embed(
        self, token_ids: torch.Tensor, image_rows: torch.Tensor | None, is_image: torch.Tensor | None
    ) -> torch.Tensor:
        """The embeddings of ``token_ids``, each image placeholder's (``is_image``) replaced by its image row."""
        embeds = self.embed_tokens(token_ids)
        if image_rows is not None and image_rows.numel():
            assert is_image is not None, "a chunk with image rows has its image mask"
            embeds[is_image] = image_rows.to(self.device, self.dtype)
        return embeds

    @property
    def num_parameters(self) -> int:
        """The model's parameters: the language model's, its embedding and head included (and the
        vision tower's where the runner holds the whole model: the adapter)."""
        return sum(p.numel() for p in self.model.parameters())

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of K and V one block holds across all layers."""
        k_cache = self.kv_caches[0][0]
        return 2 * len(self.kv_caches) * self.block_size * k_cache[0].numel() * k_cache.element_size()

    def _slots(self, block_table: list[int], num_tokens: int) -> list[int]:
        return [block_table[p // self.block_size] * self.block_size + p % self.block_size for p in range(num_tokens)]

    def prefill_inputs(self, start: int, end: int, block_table: list[int]) -> AttentionBatch:
        """Where the chunk ``start:end`` of one sequence goes in the cache and which keys it sees."""
        slots = self._slots(block_table, end)
        return AttentionBatch(
            positions=torch.arange(start, end, device=self.device)[None],
            slot_mapping=torch.tensor(slots[start:], device=self.device),
            key_slots=torch.tensor(slots, device=self.device)[None],
            key_valid=torch.ones(1, end, dtype=torch.bool, device=self.device),
        )

    def batch_prefill_inputs(
        self, chunks: list[PrefillChunk]
    ) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch of several sequences' chunks (row b: chunk b, padded to the longest), their token
        ids ``[N]`` as one row, which are image placeholders ``[N]``, and each chunk's last token in it ``[B]``."""
        lengths = [len(c.token_ids) for c in chunks]
        tq, max_len = max(lengths), max(c.end for c in chunks)
        positions = torch.zeros(len(chunks), tq, dtype=torch.long)
        key_slots = torch.zeros(len(chunks), max_len, dtype=torch.long)
        key_valid = torch.zeros(len(chunks), max_len, dtype=torch.bool)
        slot_mapping, query_index, masks = [], [], []
        ids = torch.tensor([t for c in chunks for t in c.token_ids])
        for row, (chunk, offset) in enumerate(
            zip(chunks, torch.tensor([0, *lengths]).cumsum(0).tolist(), strict=False)
        ):
            slots = self._slots(chunk.block_table, chunk.end)
            positions[row, : len(chunk.token_ids)] = torch.arange(chunk.start, chunk.end)
            key_slots[row, : chunk.end] = torch.tensor(slots)
            key_valid[row, : chunk.end] = True
            slot_mapping += slots[chunk.start :]
            query_index.append(torch.arange(len(chunk.token_ids)) + row * tq)
            masks.append(self.image_mask(ids[offset : offset + len(chunk.token_ids)], chunk.num_prompt_tokens))
        batch = AttentionBatch(
            positions=positions.to(self.device),
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            key_slots=key_slots.to(self.device),
            key_valid=key_valid.to(self.device),
            query_index=torch.cat(query_index).to(self.device),
        )
        if any(c.rope_positions is not None for c in chunks):  # 1-D rows as three equal rows
            rope = [
                c.rope_positions if c.rope_positions is not None else p.expand(3, -1)
                for c, p in zip(chunks, positions, strict=True)
            ]
            batch.rope_positions = torch.cat([r[:, :n] for r, n in zip(rope, lengths, strict=True)], 1).to(self.device)
        if self.atomic_image_spans and self.image_token_id is not None:
            spans = [image_span_ids(m, c.start)[0] for m, c in zip(masks, chunks, strict=True)]
            batch.image_spans = torch.stack([F.pad(s, (0, max_len - len(s)), value=-1) for s in spans]).to(self.device)
        last = torch.tensor(lengths).cumsum(0) - 1
        return batch, ids.to(self.device), torch.cat(masks).to(self.device), last.to(self.device)

    @torch.inference_mode()  # inference tensors, as the compiled forward's graphs expect (sampling/compiled.py)
    def decode_inputs(self, positions: list[int], block_tables: list[list[int]]) -> AttentionBatch:
        """Where each of B decode tokens goes in the cache and which keys it sees.

        A fixed handful of torch calls whatever B: the per-row loop this replaces made ~10 per row
        (0.94 ms at B = 32, now 0.10 ms), each a GIL handoff when another thread runs Python beside it.
        """
        bs = self.block_size
        num_blocks = -(-(max(positions) + 1) // bs)
        # L is whole blocks, so the attention's shapes change once every block_size steps, not at every
        # step: on the H100 the cuDNN attention built a new execution plan per new shape
        max_len = num_blocks * bs
        # tables: [B, num_blocks] each row's blocks in position order, padded with block 0
        tables = torch.tensor([(t + [0] * num_blocks)[:num_blocks] for t in block_tables])
        slots = (tables[:, :, None] * bs + torch.arange(bs)).flatten(1)  # [B, L] slot of position j
        pos = torch.tensor(positions)
        key_valid = torch.arange(max_len)[None] <= pos[:, None]  # [B, L]
        return AttentionBatch(
            positions=pos.to(self.device)[:, None],
            slot_mapping=slots[torch.arange(len(positions)), pos].to(self.device),
            key_slots=slots.where(key_valid, 0).to(self.device, non_blocking=True),
            key_valid=key_valid.to(self.device, non_blocking=True),
        )

    @torch.inference_mode()
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of blocks ``src`` into ``dst`` (n > 1 children share their parent's prefill)."""
        bs = self.block_size
        src_slots = (torch.tensor(src)[:, None] * bs + torch.arange(bs)).flatten().to(self.device)
        dst_slots = (torch.tensor(dst)[:, None] * bs + torch.arange(bs)).flatten().to(self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst_slots] = k_cache[src_slots]
            v_cache[dst_slots] = v_cache[src_slots]

    def prefill(
        self,
        token_ids: list[int],
        start: int,
        block_table: list[int],
        image_rows: torch.Tensor | None,
        *,
        num_prompt_tokens: int | None = None,
    ) -> torch.Tensor:
        """Run the chunk ``token_ids`` at positions ``start...`` of one sequence; logits ``[1, vocab]``
        of its last token. ``image_rows`` holds the embedding of each image placeholder in the chunk
        (the prompt's image tokens: its first ``num_prompt_tokens``, see ``image_mask``)."""
        raise NotImplementedError

    def prefill_batch(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Run one chunk of each of several sequences in one forward; logits ``[len(chunks), vocab]``
        of each chunk's last token, equal to those of ``prefill`` run on each chunk alone."""
        raise NotImplementedError

    @torch.inference_mode()
    def decode(self, token_ids: list[int] | torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """One token for each of B sequences, placed by ``batch`` (from ``decode_inputs``); logits
        ``[B, vocab]``. ``token_ids`` may already be on the device (the last step's samples)."""
        forward = self.compiled_decode or self.decode_forward
        return forward(torch.as_tensor(token_ids, device=self.device), batch)

    def decode_forward(self, ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The decode step's model forward: token ids ``[B]`` in, logits ``[B, vocab]`` out (what
        ``compile_decode`` compiles)."""
        raise NotImplementedError

    def compile_decode(self) -> None:
        """Run the decode forward compiled by ``torch.compile`` from now on (sampling/compiled.py);
        the first steps of each new graph pay its compile (seconds; a warm on-disk cache: less)."""
        from sampling.compiled import compile_decode_forward

        self.compiled_decode = compile_decode_forward(self.decode_forward)

    def warm_up_decode(self) -> None:
        """Run a decode step at B = 1 and at B = 2, so that a compiled forward's graph (one for both)
        compiles now (a start) rather than in a request's first steps, where it would count against
        the step timeout. Writes junk K/V into the pad block, which no sequence holds."""
        for size in (1, 2):
            self.decode([0] * size, self.decode_inputs(list(range(size)), [[self.pad_block]] * size))
