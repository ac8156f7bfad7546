"""Several sequences' prefill chunks in one forward (``prefill_batch``) give each chunk's logits as
``prefill`` gives them alone, for the hand-written decoder and the transformers adapter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sampling.hf_adapter import HFModelRunner
from sampling.model_runner import ModelRunner
from sampling.paged_runner import PagedRunner, PrefillChunk
from tests.sampling.helpers import NUM_BLOCKS, reference_logits
from vision.checkpoint import Checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_runner(checkpoint: Checkpoint) -> HFModelRunner:
    return HFModelRunner(checkpoint, device="cpu", max_model_len=4096, num_blocks=NUM_BLOCKS, block_size=16)


@pytest.fixture(params=["hand-written", "transformers"])
def any_runner(request: pytest.FixtureRequest, runner: ModelRunner, hf_runner: HFModelRunner) -> PagedRunner:
    return runner if request.param == "hand-written" else hf_runner


def _sequences(checkpoint: Checkpoint, hidden_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three prompts of different lengths, the second with image placeholders; its image rows."""
    gen = torch.Generator().manual_seed(3)
    img = checkpoint.image_token_id
    first = torch.randint(20, 131_072, (37,), generator=gen)
    second = torch.tensor([1, 3, img, img, img, 12, img, img, 13, 500, 4, 700, 800])
    third = torch.randint(20, 131_072, (5,), generator=gen)
    return [first, second, third], torch.randn(5, hidden_size, generator=gen)


def test_a_batch_of_chunks_gives_each_chunk_its_own_logits(
    any_runner: PagedRunner, checkpoint: Checkpoint, reference: Any
) -> None:
    """Chunks of different lengths, one after a prefix already in the cache (a prefix-cache hit),
    one with image rows: the batch's rows equal transformers' logits and those of lone chunks."""
    runner = any_runner
    seqs, rows = _sequences(checkpoint, runner.cfg.hidden_size)
    # the first sequence's first 16 tokens are in the cache already; its chunk starts after them
    runner.prefill(seqs[0][:16].tolist(), 0, [40, 41, 42], None)
    runner.prefill(seqs[0][:16].tolist(), 0, [50, 51, 52], None)
    alone = [
        runner.prefill(seqs[0][16:].tolist(), 16, [40, 41, 42], None),
        runner.prefill(seqs[1].tolist(), 0, [43], rows),
        runner.prefill(seqs[2].tolist(), 0, [44], None),
    ]
    chunks = [
        PrefillChunk(seqs[0][16:].tolist(), 16, [50, 51, 52], None),
        PrefillChunk(seqs[1].tolist(), 0, [53], rows),
        PrefillChunk(seqs[2].tolist(), 0, [54], None),
    ]
    batched = runner.prefill_batch(chunks)
    assert batched.shape == (3, runner.cfg.vocab_size)
    for row, logits in enumerate(alone):
        torch.testing.assert_close(batched[row], logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(batched[0], reference_logits(reference, seqs[0])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(batched[2], reference_logits(reference, seqs[2])[-1], atol=ATOL, rtol=0)
    # the batch wrote each chunk's K/V where its own table says: decoding on from them agrees too
    batch = runner.decode_inputs([36, 12, 4], [[50, 51, 52], [53], [54]])
    lone = runner.decode_inputs([36, 12, 4], [[40, 41, 42], [43], [44]])
    ids = [int(seqs[0][36]), int(seqs[1][12]), int(seqs[2][4])]
    torch.testing.assert_close(runner.decode(ids, batch), runner.decode(ids, lone), atol=ATOL, rtol=0)


def test_a_replay_past_the_prompt_embeds_generated_image_tokens_as_text(
    any_runner: PagedRunner, checkpoint: Checkpoint
) -> None:
    """A chunk that runs past its prompt (a replay after a preemption) beside another: the image
    token it generated is text there, as in a lone chunk (``num_prompt_tokens``)."""
    runner = any_runner
    img = checkpoint.image_token_id
    replay = [1, 3, 500, 600, img, 700]  # prompt of 4, then two generated tokens, one the image id
    other = [1, 5, 9, 11, 13, 15, 17]
    alone = [
        runner.prefill(replay, 0, [60], None, num_prompt_tokens=4),
        runner.prefill(other, 0, [61], None),
    ]
    batched = runner.prefill_batch(
        [PrefillChunk(replay, 0, [62], None, num_prompt_tokens=4), PrefillChunk(other, 0, [63], None)]
    )
    for row, logits in enumerate(alone):
        torch.testing.assert_close(batched[row], logits[0], atol=ATOL, rtol=0)
