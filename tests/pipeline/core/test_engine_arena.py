"""The engine arena: its ring allocator's regions, and tensors that cross through it."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.arena import ALIGN, EngineArena, RingAllocator


def test_regions_are_aligned_and_taken_one_after_another() -> None:
    ring = RingAllocator(1024)
    assert [ring.alloc(n) for n in (1, 64, 65, 0)] == [0, 64, 128, 256]
    assert ring.num_live == 4 and ring.used == 64 + 64 + 128 + 64


def test_freed_oldest_first_and_empty_starts_again_at_zero() -> None:
    ring = RingAllocator(1024)
    assert ring.alloc(100) == 0 and ring.alloc(100) == 128
    assert ring.free_oldest() == 0 and ring.free_oldest() == 128
    assert ring.num_live == 0 and ring.alloc(10) == 0
    with pytest.raises(IndexError):
        RingAllocator(64).free_oldest()


def test_a_region_that_does_not_fit_at_the_end_wraps_to_the_start() -> None:
    ring = RingAllocator(1024)
    assert [ring.alloc(256) for _ in range(3)] == [0, 256, 512]
    ring.free_oldest()  # [0, 256) is free; the head is at 768, 256 bytes before the end
    assert ring.alloc(320) is None  # fits neither after the head (256) nor before the tail (256)
    assert ring.alloc(256) == 768  # exactly up to the end
    assert ring.alloc(192) == 0  # wrapped: before the tail at 256
    assert ring.alloc(128) is None  # wrapped: only the 64 bytes between the head and the tail
    assert ring.alloc(64) == 192  # the gap exactly
    assert ring.alloc(1) is None  # full
    assert [ring.free_oldest() for _ in range(5)] == [256, 512, 768, 0, 192]
    assert ring.alloc(1024) == 0


def test_too_big_or_full_gives_none_and_reset_frees_everything() -> None:
    ring = RingAllocator(512)
    assert ring.alloc(513) is None
    assert ring.alloc(512) == 0 and ring.alloc(1) is None
    ring.reset()
    assert ring.num_live == 0 and ring.alloc(512) == 0


def test_tensors_cross_in_one_region_and_are_freed_when_their_add_is_read() -> None:
    arena = EngineArena.create(4 * 1024)
    try:
        embeds = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        extra = torch.arange(3 * 2 * 5, dtype=torch.float32).view(3, 2, 5)
        placed = arena.put({"a": embeds, "b": extra})
        assert placed == (("a", 0, (3, 5), "bfloat16"), ("b", ALIGN, (3, 2, 5), "float32"))
        arena.hold_until(7)
        back = arena.take(placed)
        assert torch.equal(back["a"], embeds) and torch.equal(back["b"], extra)
        # the copies outlive the region: the next add's bytes overwrite it
        arena.acked(7)
        assert arena.num_regions == 0
        assert arena.put({"a": torch.zeros(3, 5, dtype=torch.bfloat16)}) == (("a", 0, (3, 5), "bfloat16"),)
        assert torch.equal(back["a"], embeds)
    finally:
        arena.close()


def test_regions_are_freed_only_once_the_engine_has_read_their_add() -> None:
    arena = EngineArena.create(1024)
    try:
        for number in (2, 5):
            assert arena.put({"x": torch.zeros(64)}) is not None
            arena.hold_until(number)
        assert arena.put({"x": torch.zeros(200)}) is None  # 256 + 256 taken, 800 bytes wanted
        arena.acked(4)
        assert arena.num_regions == 1
        arena.acked(5)
        assert arena.num_regions == 0
        arena.put({"x": torch.zeros(64)})
        arena.hold_until(9)
        arena.reset()
        assert arena.num_regions == 0
    finally:
        arena.close()
