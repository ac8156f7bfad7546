"""The decode step's inputs in tensors allocated once, each batch padded up to a bucket.

A decode step replayed as a CUDA graph runs fixed kernels on fixed addresses with fixed shapes: what
it reads must sit in tensors allocated once and rewritten in place before each replay, and its shapes
must come from a small set, each captured once. ``DecodeBuffers`` gives the decode forward inputs of
that kind, on any device:

- **Rows.** A batch of B sequences runs as the smallest row bucket that holds it (1, 2, 4, then every
  multiple of 8: the sizes vLLM captures). A padding row sits at position 0 of the *pad block*, a
  block of the KV cache that no sequence is ever given (``PagedRunner.pad_block``): it writes its
  junk K/V there, reads only that, and its logits are dropped.
- **Keys.** Each row's block table is read from the buffer up to the bucket's key length: the
  smallest power-of-two count of blocks that holds the longest row (fewer than twice the blocks that
  row needs; a shorter row reads as many), and each row sees its keys up to its position, read from
  the positions buffer.
- **One copy a step.** The host writes every row's token id, position, RoPE position and block table
  into one tensor, copied to the device in one transfer (on CUDA from pinned memory, so that the copy
  never waits for the stream); ids already on the device (the last step's samples, one step ahead)
  are copied there device to device.

After the copy, ``view`` is device work alone with no host synchronisation: with the forward, what a
capture would record once per bucket. A padding row changes no real row's tokens: a decode forward treats its rows
apart (they meet only in attention, through each row's own block table). A matrix product of more
rows may round differently, which the tests show changes no token on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sampling.kv_cache import blocks_needed
from sampling.paged_attention import AttentionBatch

__all__ = ["DecodeBuffers", "DecodeBucket", "row_buckets"]

_ID, _POSITION, _ROPE, _TABLE = 0, 1, 2, 3  # the rows of the inputs buffer: one column per batch row


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The padded batch sizes for batches of up to ``max_rows`` rows: 1, 2, 4, then every multiple of
    8 up to the first that holds ``max_rows``; up to 4 rows, the sizes under it and itself."""
    small = [size for size in (1, 2, 4) if size < max_rows]
    return (*small, *range(8, max_rows + 8, 8)) if max_rows > 4 else (*small, max_rows)


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """The shape a decode step runs at: what a captured graph is keyed by."""

    rows: int  # the batch padded: a row bucket
    blocks: int  # key length in blocks: a power of two (or the most a sequence can hold)
    rope: bool  # the rows carry RoPE positions apart from their cache positions (M-RoPE offsets)


class DecodeBuffers:
    """The inputs of every decode step of one engine, in device tensors allocated once."""

    def __init__(
        self, *, max_rows: int, max_model_len: int, block_size: int, pad_block: int, device: torch.device
    ) -> None:
        self.row_buckets = row_buckets(max_rows)
        self.block_size = block_size
        self.max_blocks = blocks_needed(max_model_len, block_size)
        self.pad_block = pad_block
        rows = self.row_buckets[-1]
        # inference tensors, as every step's inputs are (a compiled forward guards on the kind)
        self._pinned = device.type == "cuda"
        if self._pinned:  # the host side of the copy, and its end: the staging is rewritten only after it
            self._staging = torch.empty((_TABLE + self.max_blocks) * rows, dtype=torch.long).pin_memory()
            self._copied = torch.cuda.Event()
        with torch.inference_mode():
            # a column per batch row: token id, position, RoPE position, then the block table (the pad
            # block beyond it); column-major, so that a step's ids and positions are contiguous views
            self.inputs = torch.zeros(_TABLE + self.max_blocks, rows, dtype=torch.long, device=device)
            self.key_offsets = torch.arange(block_size, device=device)  # a slot's place in its block
            self.key_positions = torch.arange(self.max_blocks * block_size, device=device)

    def bucket(self, num_rows: int, max_position: int, rope: bool) -> DecodeBucket:
        """The bucket of a step of ``num_rows`` rows whose furthest row writes at ``max_position``."""
        if num_rows > self.row_buckets[-1]:
            raise ValueError(f"a decode step of {num_rows} rows; the buffers hold {self.row_buckets[-1]}")
        rows = next(size for size in self.row_buckets if size >= num_rows)
        needed = max_position // self.block_size + 1
        return DecodeBucket(rows, min(1 << (needed - 1).bit_length(), self.max_blocks), rope)

    @torch.inference_mode()
    def load(
        self,
        ids: list[int] | torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
        rope_deltas: list[int] | None = None,
    ) -> DecodeBucket:
        """Write a step's rows into the buffers, padding rows after them; the step's bucket.
        ``rope_deltas``: each row's M-RoPE offset (its RoPE position is its position plus it)."""
        deltas = rope_deltas if rope_deltas is not None and any(rope_deltas) else None
        bucket = self.bucket(len(positions), max(positions), deltas is not None)
        blocks, pad = bucket.blocks, self.pad_block
        host_ids = ids if isinstance(ids, list) else [0] * len(positions)
        rows = [
            [token, p, p + (deltas[row] if deltas is not None else 0), *table[:blocks], *[pad] * (blocks - len(table))]
            for row, (token, p, table) in enumerate(zip(host_ids, positions, tables, strict=True))
        ]
        rows += [[0, 0, 0, *[pad] * blocks]] * (bucket.rows - len(rows))
        staged = torch.tensor(rows).T  # [_TABLE + blocks, bucket rows]
        if self._pinned:
            self._copied.synchronize()  # the last step's copy has read the staging memory (no-op: long done)
            pinned = self._staging[: staged.numel()].view(staged.shape)
            staged = pinned.copy_(staged)
        self.inputs[: _TABLE + blocks, : bucket.rows].copy_(staged, non_blocking=True)
        if self._pinned:
            self._copied.record()
        if isinstance(ids, torch.Tensor):
            self.inputs[_ID, : len(positions)].copy_(ids)
        return bucket

    def view(self, bucket: DecodeBucket) -> tuple[torch.Tensor, AttentionBatch]:
        """The token ids ``[rows]`` and attention batch of the step ``load`` wrote last (``bucket``, what
        it returned): views of the buffers and what device work computes from them, the part of a step
        a capture would record with the forward. The ids, positions and key tensors are contiguous, as
        ``decode_inputs`` makes them, so a compiled forward runs both on the same graph."""
        inputs = self.inputs[:, : bucket.rows]
        positions = inputs[_POSITION]
        tables = inputs[_TABLE : _TABLE + bucket.blocks].T
        key_slots = (tables[:, :, None] * self.block_size + self.key_offsets).flatten(1)  # [rows, L]
        batch = AttentionBatch(
            positions=positions[:, None],
            slot_mapping=key_slots.gather(1, positions[:, None])[:, 0],
            key_slots=key_slots,
            key_valid=self.key_positions[: key_slots.shape[1]][None] <= positions[:, None],
        )
        if bucket.rope:
            batch.rope_positions = inputs[_ROPE].expand(3, -1).contiguous()
        return inputs[_ID], batch
