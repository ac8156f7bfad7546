"""Paged KV memory: fixed-size blocks, reference counted, shared by content.

A block is referenced by every running sequence whose block table holds it (n > 1 children share
their parent's full prompt blocks; sequences with a common prefix share its blocks). A full block
whose K/V is computed may be *registered* under the hash of its tokens (sampling/prefix_cache.py):
when its last reference goes it stays in the cache, free but findable, and the least recently freed
of those is evicted only when a fresh block is needed and no never-used one is left.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["BlockAllocator", "PrefixCacheStats", "allocate_kv_caches", "blocks_needed"]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters of the KV prefix cache, in blocks (written by the engine thread, read anywhere)."""

    hits: int = 0  # full prompt blocks found in the cache at admission
    misses: int = 0  # full prompt blocks looked up and not found
    evictions: int = 0  # registered blocks reused for other content
    blocks_held: int = 0  # registered blocks (in use or free), whose K/V a later prompt may reuse


class BlockAllocator:
    """Hands out block ids; the scheduler is its only caller, so no lock is needed."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # never registered, or evicted
        self._refs = [0] * num_blocks
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced: LRU first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: the free ones and the cached ones nobody references."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_referenced(self) -> int:
        """Blocks some sequence holds (0 when the engine is idle)."""
        return self.num_blocks - self.num_free

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh block ids, each referenced once.

        :raises MemoryError: when fewer are free (callers check num_free)."""
        if count > self.num_free:
            raise MemoryError(f"{count} KV blocks asked, {self.num_free} free")
        taken = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:  # the least recently freed cached block gives up its content
                block, _ = self._cached_free.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                self.stats.evictions += 1
                self.stats.blocks_held -= 1
            self._refs[block] = 1
            taken.append(block)
        return taken

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (a cached free one is in use again)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._cached_free[block]
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; the last one frees it (kept if registered).
        The tail of a table is freed first, so a prefix outlives its continuations."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than taken")
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached_free[block] = None
                else:
                    self._free.append(block)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def register(self, block: int, block_hash: bytes) -> None:
        """Make ``block`` (referenced, full, its K/V computed) findable by ``block_hash``. A hash
        already held by another block keeps that block: this one stays private."""
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self.stats.blocks_held += 1


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
