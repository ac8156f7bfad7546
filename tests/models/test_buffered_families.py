"""The padded, buffered decode step (sampling/decode_buffers.py) gives the logits of the step built at
its own size in the families whose attention or positions differ from Mistral's: Gemma 2's
soft-capping, Gemma 3's sliding window (passed by the longest row, its keys padded beyond it),
Qwen 3's qk-norm, Qwen2.5-VL's M-RoPE offsets, each through the adapter over transformers' classes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sampling.decode_buffers import DecodeBuffers
from sampling.families import build_runner
from tests.models.test_compiled_families import CASES, LENGTHS
from vision.checkpoint import Checkpoint


@pytest.mark.parametrize(("family", "rope_delta"), CASES)
@torch.inference_mode()
def test_the_buffered_decode_gives_the_step_s_logits(
    family_dir: Callable[[str], Path], family: str, rope_delta: int
) -> None:
    runner = build_runner(Checkpoint(family_dir(family)), device="cpu", max_model_len=512, num_blocks=32, block_size=16)
    buffers = DecodeBuffers(
        max_rows=8, max_model_len=512, block_size=16, pad_block=runner.pad_block, device=runner.device
    )
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(20, runner.cfg.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    tables = [[0, 1, 2, 3, 4], [5], [6, 7, 8]]
    for seq, table in zip(seqs, tables, strict=True):
        runner.prefill(seq[:-1], 0, table, None)
    positions, deltas = [n - 1 for n in LENGTHS], [rope_delta] * len(LENGTHS)
    ids = [s[-1] for s in seqs]
    # the same step twice: each writes the same K/V at the same slots
    batch = runner.decode_inputs(positions, tables)
    if rope_delta:
        batch.rope_positions = (torch.tensor(positions) + rope_delta).expand(3, -1)
    expected = runner.decode(ids, batch)
    bucket = buffers.load(ids, positions, tables, deltas)
    assert (bucket.rows, bucket.blocks, bucket.rope) == (4, 8, bool(rope_delta))  # padded: 3 rows, 5 blocks
    padded = runner.decode(*buffers.view(bucket))[: len(ids)]
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=0)
    assert torch.equal(padded.argmax(-1), expected.argmax(-1))
