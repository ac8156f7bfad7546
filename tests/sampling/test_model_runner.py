"""Our paged-KV decoder gives the same logits as transformers' implementation of the checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from sampling.model_runner import ModelRunner
from tests.sampling.helpers import reference_logits
from vision.checkpoint import Checkpoint

ATOL = 1e-4


def test_chunked_prefill_and_batched_decode_match_transformers(runner: ModelRunner, reference: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    seq_a = torch.randint(20, 131_072, (40,), generator=gen)
    seq_b = torch.randint(20, 131_072, (29,), generator=gen)
    expected_a, expected_b = reference_logits(reference, seq_a), reference_logits(reference, seq_b)
    # scattered, non-monotonic blocks; chunks end mid-block, so positions cross block boundaries
    table_a, table_b = [5, 9, 3], [7, 1, 11]
    for start, end in [(0, 7), (7, 17), (17, 30)]:
        logits = runner.prefill(seq_a[start:end].tolist(), start, table_a, None)
        torch.testing.assert_close(logits[0], expected_a[end - 1], atol=ATOL, rtol=0)
    logits = runner.prefill(seq_b[:19].tolist(), 0, table_b, None)
    torch.testing.assert_close(logits[0], expected_b[18], atol=ATOL, rtol=0)
    # two sequences of different lengths in one decode batch: padding keys must stay invisible
    for step in range(10):
        pos_a, pos_b = 30 + step, 19 + step
        batch = runner.decode_inputs([pos_a, pos_b], [table_a, table_b])
        logits = runner.decode([int(seq_a[pos_a]), int(seq_b[pos_b])], batch)
        torch.testing.assert_close(logits[0], expected_a[pos_a], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], expected_b[pos_b], atol=ATOL, rtol=0)


def test_image_embeddings_at_image_tokens_match_inputs_embeds(
    runner: ModelRunner, checkpoint: Checkpoint, reference: Any
) -> None:
    img = checkpoint.image_token_id
    ids = torch.tensor([1, 3, img, img, img, 12, img, img, img, 13, 500, 4, 700, 800, 900, 1000, 1100, 1200])
    rows = torch.randn(6, runner.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        embeds = reference.get_input_embeddings()(ids[None])
        embeds[ids[None] == img] = rows
        expected = reference(inputs_embeds=embeds).logits[0]
    table = [2, 6]
    # two chunks: the first ends inside the image, so each chunk carries only its own image rows
    first = runner.prefill(ids[:4].tolist(), 0, table, rows[:2])
    second = runner.prefill(ids[4:].tolist(), 4, table, rows[2:])
    torch.testing.assert_close(first[0], expected[3], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], expected[-1], atol=ATOL, rtol=0)
    assert not torch.allclose(second[0], reference_logits(reference, ids)[-1], atol=ATOL)  # the rows matter
