"""Paged KV memory: fixed-size blocks handed out to sequences from one free list."""

from __future__ import annotations

import torch

__all__ = ["BlockAllocator", "allocate_kv_caches", "blocks_needed"]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out block ids; the scheduler is its only caller, so no lock is needed."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` block ids. :raises MemoryError: when fewer are free (callers check num_free)."""
        if count > len(self._free):
            raise MemoryError(f"{count} KV blocks asked, {len(self._free)} free")
        taken = self._free[-count:] if count else []
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key, value) pair per layer, each ``[num_blocks * block_size, kv_heads, head_dim]``."""
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
        for _ in range(num_layers)
    ]
