"""Slab: a shared-memory buffer between the serving process and one preparation worker.

A slab is an anonymous memory file (``memfd_create``) mapped in both processes; its file descriptor
crosses the worker's pipe (``SCM_RIGHTS``), never a name. Nothing is ever created in ``/dev/shm``,
so nothing can be left there: the memory is freed when the last of the two processes closes or
dies, whatever way it dies. Image bytes go in through the serving process's slab, tensors come back
through the worker's; each side copies out what it keeps, so a slab is reused by the next job.
"""

from __future__ import annotations

import mmap
import os

import numpy
import torch

__all__ = ["Slab"]


class Slab:
    """``size`` bytes of shared memory, writable through ``view`` (one job at a time)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size)

    @classmethod
    def create(cls, name: str, size: int) -> Slab:
        """A new slab; pages are only allocated where they are written."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return cls(fd, size)

    @classmethod
    def attach(cls, fd: int) -> Slab:
        """The slab behind ``fd`` (received from the other process)."""
        return cls(fd, os.fstat(fd).st_size)

    def write_bytes(self, data: bytes | memoryview) -> int:
        if len(data) > self.size:
            raise ValueError(f"{len(data)} bytes do not fit a slab of {self.size}")
        self._map[: len(data)] = data
        return len(data)

    def read_bytes(self, num_bytes: int) -> bytes:
        return self._map[:num_bytes]

    def write_tensor(self, tensor: torch.Tensor) -> None:
        flat = tensor.detach().contiguous().view(-1)
        nbytes = flat.numel() * flat.element_size()
        if nbytes > self.size:
            raise ValueError(f"a tensor of {nbytes} bytes does not fit a slab of {self.size}")
        torch.frombuffer(self._map, dtype=flat.dtype, count=flat.numel()).copy_(flat)

    def read_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A copy (the slab is reused by the next job) of the tensor written there."""
        count = 1
        for dim in shape:
            count *= dim
        return torch.frombuffer(self._map, dtype=dtype, count=count).clone().view(shape)

    def write_tensor_at(self, offset: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the slab at byte ``offset`` (its one copy on the writing side)."""
        # a byte copy in this thread: torch's copy_ would split it over its intra-op threads, whose
        # hand-offs cost milliseconds of spinning on a loaded machine (the event loop's time)
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if offset < 0 or offset + raw.size > self.size:
            raise ValueError(f"{raw.size} bytes at {offset} do not fit a slab of {self.size}")
        numpy.frombuffer(self._map, numpy.uint8, raw.size, offset)[:] = raw

    def tensor_at(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor at byte ``offset``, a view of the slab (no copy: valid while its region is)."""
        count = 1
        for dim in shape:
            count *= dim
        if not count:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset).view(shape)

    def copy_out(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A copy of the tensor at byte ``offset`` (a byte copy in this thread, as ``write_tensor_at``)."""
        out = torch.empty(shape, dtype=dtype)
        raw = out.view(-1).view(torch.uint8).numpy()
        if raw.size:
            raw[:] = numpy.frombuffer(self._map, numpy.uint8, raw.size, offset)
        return out

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)
