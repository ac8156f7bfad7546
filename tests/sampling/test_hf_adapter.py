"""The adapter (the checkpoint's own transformers model over our paged KV cache) gives transformers'
own logits and greedy answers on the embedded default model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sampling.detokenizer import TokenBytes
from sampling.hf_adapter import HFModelRunner
from tests.sampling.helpers import NUM_BLOCKS, add, make_engine, prompt, reference_logits, run_all
from vision.checkpoint import Checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_runner(checkpoint: Checkpoint) -> HFModelRunner:
    return HFModelRunner(checkpoint, device="cpu", max_model_len=4096, num_blocks=NUM_BLOCKS, block_size=16)


def test_chunked_prefill_and_batched_decode_match_transformers(hf_runner: HFModelRunner, reference: Any) -> None:
    runner = hf_runner
    gen = torch.Generator().manual_seed(0)
    seq_a = torch.randint(20, 131_072, (40,), generator=gen)
    seq_b = torch.randint(20, 131_072, (29,), generator=gen)
    seq_c = torch.randint(20, 131_072, (8,), generator=gen)
    expected = [reference_logits(reference, s) for s in (seq_a, seq_b, seq_c)]
    # scattered, non-monotonic blocks; chunks end mid-block, so positions cross block boundaries
    tables = [[5, 9, 3], [7, 1, 11], [4]]
    for start, end in [(0, 7), (7, 17), (17, 30)]:
        logits = runner.prefill(seq_a[start:end].tolist(), start, tables[0], None)
        torch.testing.assert_close(logits[0], expected[0][end - 1], atol=ATOL, rtol=0)
    for seq, table, exp in [(seq_b, tables[1], expected[1]), (seq_c, tables[2], expected[2])]:
        logits = runner.prefill(seq[:4].tolist(), 0, table, None)
        torch.testing.assert_close(logits[0], exp[3], atol=ATOL, rtol=0)
    # three sequences of different lengths in one decode batch: padding keys must stay invisible
    for step in range(4):
        positions = [30 + step, 4 + step, 4 + step]
        batch = runner.decode_inputs(positions, tables)
        logits = runner.decode([int(s[p]) for s, p in zip((seq_a, seq_b, seq_c), positions, strict=True)], batch)
        for row, (exp, pos) in enumerate(zip(expected, positions, strict=True)):
            torch.testing.assert_close(logits[row], exp[pos], atol=ATOL, rtol=0)


def test_a_prefix_cache_hit_reads_the_shared_blocks(hf_runner: HFModelRunner, reference: Any) -> None:
    """A second prompt with the first one's first block prefills only its own tail."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(20, 131_072, (16,), generator=gen)
    first = torch.cat([shared, torch.randint(20, 131_072, (5,), generator=gen)])
    second = torch.cat([shared, torch.randint(20, 131_072, (9,), generator=gen)])
    hf_runner.prefill(first.tolist(), 0, [20, 21], None)
    logits = hf_runner.prefill(second[16:].tolist(), 16, [20, 22], None)  # block 20 reused
    torch.testing.assert_close(logits[0], reference_logits(reference, second)[-1], atol=ATOL, rtol=0)


def test_image_embeddings_at_image_tokens_match_inputs_embeds(
    hf_runner: HFModelRunner, checkpoint: Checkpoint, reference: Any
) -> None:
    img = checkpoint.image_token_id
    ids = torch.tensor([1, 3, img, img, img, 12, img, img, img, 13, 500, 4, 700, 800, 900, 1000, 1100, 1200])
    rows = torch.randn(6, hf_runner.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        embeds = reference.get_input_embeddings()(ids[None])
        embeds[ids[None] == img] = rows
        expected = reference(inputs_embeds=embeds).logits[0]
    table = [2, 6]
    first = hf_runner.prefill(ids[:4].tolist(), 0, table, rows[:2])
    second = hf_runner.prefill(ids[4:].tolist(), 4, table, rows[2:])
    torch.testing.assert_close(first[0], expected[3], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], expected[-1], atol=ATOL, rtol=0)


def test_greedy_answers_equal_transformers_generate(
    hf_runner: HFModelRunner, reference: Any, token_bytes: TokenBytes, hf_tokenizer: Any
) -> None:
    """A batch of prompts of different lengths, chunked prefill, then the same prompts again
    (prefix-cache hits): every answer is transformers' own greedy continuation."""
    prompts = [
        prompt(hf_tokenizer, text)
        for text in (
            "Hi",
            "Tell me a long story about a fox who lives in a forest and jumps over the lazy dog",
            "What is 2+2?",
        )
    ]
    expected = []
    for ids in prompts:
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    engine = make_engine(hf_runner, token_bytes, chunk_tokens=5, prefix_caching=True)
    for round_ in range(2):
        for i, ids in enumerate(prompts):
            add(engine, f"r{round_}-{i}", ids, max_tokens=10, temperature=0.0)
        outputs = run_all(engine)
        for i in range(len(prompts)):
            assert outputs[(f"r{round_}-{i}", 0)].token_ids == expected[i]
    assert engine.scheduler.allocator.stats.hits > 0
