"""A generated image token is text: after a preemption, the replayed prefill embeds it as its token
(as the decode step that produced it did), never as an image row, with either model runner."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.hf_adapter import HFModelRunner
from sampling.inputs import EngineInput, ImageKey
from sampling.model_runner import ModelRunner
from sampling.params import SamplingParams
from tests.sampling.helpers import IMAGE_TOKEN, NUM_BLOCKS, make_engine, prompt, run_all
from vision.checkpoint import Checkpoint

NUM_PATCHES = 24


@pytest.fixture(scope="module")
def hf_runner(checkpoint: Checkpoint) -> HFModelRunner:
    return HFModelRunner(checkpoint, device="cpu", max_model_len=4096, num_blocks=NUM_BLOCKS, block_size=16)


def _answers(engine: LLMEngine, tokenizer: Any) -> tuple[dict[str, list[int]], int]:
    """Four image prompts whose answers are pushed (a logit bias) to the image token, and one text
    prompt, all greedy: each request's tokens and the preemptions they took."""
    hidden = engine.runner.cfg.hidden_size
    for i in range(4):
        ids = prompt(tokenizer, f"look {i}")[:-1] + [IMAGE_TOKEN] * NUM_PATCHES + prompt(tokenizer, "what?")[1:]
        rows = torch.randn(NUM_PATCHES, hidden, generator=torch.Generator().manual_seed(i))
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias=((IMAGE_TOKEN, 100.0),))
        engine.add(EngineInput(f"img{i}", ids, IMAGE_TOKEN, rows, params, image_keys=[ImageKey(f"k{i}", NUM_PATCHES)]))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add(EngineInput("text", prompt(tokenizer, "plain " * 8), IMAGE_TOKEN, None, params))
    seqs = engine.requests.sequences()
    outputs = run_all(engine)
    assert all(o.finish_reason == "length" for o in outputs.values()), outputs
    return {k[0]: o.token_ids for k, o in outputs.items()}, sum(s.num_preemptions for s in seqs)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_a_replayed_generated_image_token_is_not_an_image_row(
    impl: str, runner: ModelRunner, hf_runner: HFModelRunner, token_bytes: TokenBytes, hf_tokenizer: Any
) -> None:
    model = runner if impl == "native" else hf_runner

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        engine = make_engine(model, token_bytes, num_blocks=num_blocks, max_running=8, prefix_caching=False)
        answers = _answers(engine, hf_tokenizer)
        assert engine.scheduler.allocator.num_free == num_blocks  # every block given back
        return answers

    roomy, roomy_preemptions = run(64)
    tight, tight_preemptions = run(14)  # 5 sequences of 3-4 blocks each cannot all fit
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert all(ids == [IMAGE_TOKEN] * 40 for name, ids in roomy.items() if name != "text")
    assert tight == roomy  # the replay embeds each generated image token as the decode step did
