"""EngineArena: the shared memory an add's tensors cross in, from the serving process to its engine process.

One arena (a memfd ``Slab``, ``vision/slab.py``) per engine process: the serving process creates it
when it starts the process, which inherits its descriptor; a new process after a fault gets a new
one. Each add with tensors (``image_embeds``, ``extra_prefill``) takes one region, written by the
serving process (one copy, from the tensors preparation concatenated); the add carries only
(offset, shape, dtype) per tensor. The engine process copies the region into its own memory when it
reads the add, so the region is free as soon as the engine has acknowledged reading that command.
Copying there rather than keeping the region for the request's life is deliberate: a preempted
sequence replays its prefill and needs its embeddings again, possibly long after, and a region held
for a whole decode would tie the arena to the slowest request; the engine's copy is off the event
loop. Regions are therefore freed in the order they were taken, which is what a ring allocator does
best. An add that does not fit (arena full, or bigger than the arena) crosses inline in its frame,
as before: no add waits for room, so nothing can deadlock or be lost.
"""

from __future__ import annotations

from collections import deque

import torch

from vision.slab import Slab

__all__ = ["ALIGN", "EngineArena", "RingAllocator", "Tensors"]

ALIGN = 64  # every region and tensor starts on a cache line (and any dtype's alignment)

# (name, offset, shape, dtype name) of each tensor in a region
Tensors = tuple[tuple[str, int, tuple[int, ...], str], ...]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class RingAllocator:
    """Regions of ``size`` bytes, taken at the head and freed oldest first (as the engine reads its adds)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: deque[tuple[int, int]] = deque()  # (offset, end) of each region, oldest first

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def used(self) -> int:
        """Bytes held by live regions (padding at a wrap not counted)."""
        return sum(end - offset for offset, end in self._live)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new region of ``nbytes`` (rounded up to ``ALIGN``); None: it does not fit now."""
        nbytes = _aligned(max(nbytes, 1))
        if nbytes > self.size:
            return None
        live = self._live
        if not live:
            offset: int | None = 0
        else:
            tail, head = live[0][0], live[-1][1]
            if live[-1][0] >= tail:  # not wrapped: room after the head, else before the tail
                offset = head if self.size - head >= nbytes else (0 if tail >= nbytes else None)
            else:  # wrapped: only the gap between the head and the tail
                offset = head if tail - head >= nbytes else None
        if offset is not None:
            live.append((offset, offset + nbytes))
        return offset

    def free_oldest(self) -> int:
        """Free the oldest live region; its offset. :raises IndexError: none is live."""
        return self._live.popleft()[0]

    def reset(self) -> None:
        """Free every region (the engine process that read them is gone)."""
        self._live.clear()


class EngineArena:
    """An arena's two ends: ``put`` in the serving process, ``take`` in the engine process."""

    def __init__(self, slab: Slab) -> None:
        self.slab = slab
        self.allocator = RingAllocator(slab.size)
        self._read_after: deque[int] = deque()  # per live region, oldest first: its add's command number

    @property
    def num_regions(self) -> int:
        """Regions the engine has not yet acknowledged reading."""
        return self.allocator.num_live

    def hold_until(self, command_number: int) -> None:
        """The newest region is freed once the engine has read ``command_number`` commands (its add's)."""
        self._read_after.append(command_number)
        assert len(self._read_after) == self.allocator.num_live

    def acked(self, num_read: int) -> None:
        """The engine has read ``num_read`` commands: free the regions of the adds among them."""
        read_after = self._read_after
        while read_after and read_after[0] <= num_read:
            read_after.popleft()
            self.allocator.free_oldest()

    def reset(self) -> None:
        """Free every region (the engine process that would read them is gone)."""
        self._read_after.clear()
        self.allocator.reset()

    @classmethod
    def create(cls, size: int) -> EngineArena:
        return cls(Slab.create("engine-arena", size))

    @classmethod
    def attach(cls, fd: int) -> EngineArena:
        return cls(Slab.attach(fd))

    def put(self, tensors: dict[str, torch.Tensor]) -> Tensors | None:
        """Write ``tensors`` into one new region; where each lies, or None if they do not fit now."""
        places: list[tuple[str, int, tuple[int, ...], str]] = []
        total = 0
        for name, tensor in tensors.items():
            places.append((name, total, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
            total += _aligned(tensor.numel() * tensor.element_size())
        base = self.allocator.alloc(total)
        if base is None:
            return None
        placed = tuple((name, base + offset, shape, dtype) for name, offset, shape, dtype in places)
        for (_, offset, _, _), tensor in zip(placed, tensors.values(), strict=True):
            self.slab.write_tensor_at(offset, tensor)
        return placed

    def take(self, placed: Tensors) -> dict[str, torch.Tensor]:
        """Copies of the tensors at ``placed`` (the region is reused once the engine has read its add)."""
        return {name: self.slab.copy_out(offset, shape, getattr(torch, dtype)) for name, offset, shape, dtype in placed}

    def close(self) -> None:
        self.slab.close()
