"""Our paged-KV decoder gives the same logits as transformers' implementation of the checkpoint."""

from __future__ import annotations

import torch

from sampling.model_runner import ModelRunner
from vision.checkpoint import Checkpoint


def test_chunked_prefill_and_batched_decode_match_transformers(runner: ModelRunner, checkpoint: Checkpoint) -> None:
    from transformers import LlavaForConditionalGeneration

    reference = LlavaForConditionalGeneration.from_pretrained(checkpoint.path).eval()
    ids = torch.randint(20, 131_072, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference(input_ids=ids).logits[0]
    table_a, table_b = [5, 9, 3], [7, 8, 11]  # scattered blocks: positions cross block boundaries
    first = runner.prefill(ids[0, :17].tolist(), 0, table_a, None)
    second = runner.prefill(ids[0, 17:30].tolist(), 17, table_a, None)
    assert torch.allclose(first[0], expected[16], atol=1e-4)
    assert torch.allclose(second[0], expected[29], atol=1e-4)
    runner.prefill(ids[0, :30].tolist(), 0, table_b, None)
    for pos in range(30, 40):
        logits = runner.decode([int(ids[0, pos])] * 2, [pos, pos], [table_a, table_b])
        assert torch.allclose(logits[0], expected[pos], atol=1e-4)
        assert torch.allclose(logits[1], expected[pos], atol=1e-4)


def test_image_embeddings_replace_image_tokens(runner: ModelRunner, checkpoint: Checkpoint) -> None:
    from transformers import LlavaForConditionalGeneration

    reference = LlavaForConditionalGeneration.from_pretrained(checkpoint.path).eval()
    ids = torch.tensor([[1, 3, 10, 10, 10, 12, 10, 10, 10, 13, 500, 4]])
    rows = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        embeds = reference.get_input_embeddings()(ids)
        embeds[ids == 10] = rows
        expected = reference(inputs_embeds=embeds).logits[0, -1]
    got = runner.prefill(ids[0].tolist(), 0, [0], rows)
    assert torch.allclose(got[0], expected, atol=1e-4)
