"""Scheduling through the adapter, per text family: sequences preempted for want of KV blocks and
recomputed answer as transformers' ``generate`` does, and an ``n = 3`` request forks one prefill
into three greedy copies of ``generate`` or three seeded samples the model allows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import PipelineConfig
from pipeline.engine.factory import build_llm_engine
from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, SeqOutput
from sampling.kv_cache import blocks_needed
from sampling.params import SamplingParams
from tests.models.test_text_families import TEXT_FAMILIES
from tests.sampling.helpers import run_all
from vision.checkpoint import Checkpoint

FamilyDir = Callable[[str], Path]
MAX_TOKENS = 20
QUESTIONS = [
    "Hello world!",
    "What is in this image? Describe the picture in one sentence, please.",
    "The quick brown fox jumps over the lazy dog.",
    "How are you today? I am fine, thank you. And you?",
    '{"name": "value", "count": 42}',
    "user assistant system tool function arguments name content role",
]


def _prompts(folder: Path) -> list[list[int]]:
    tokenizer = Checkpoint(folder).tokenizer
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]


def _reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # the engine's requests ignore EOS, which bans the stop tokens: generate does the same
    model.generation_config.eos_token_id = None
    model.generation_config.suppress_tokens = [int(t) for t in Checkpoint(folder).tokenizer_info.stop_token_ids]
    return model


def _generate(model: Any, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return list(out[0, len(ids) :].tolist())


def _engine(folder: Path, num_kv_blocks: int, max_running: int = 8, **overrides: Any) -> LLMEngine:
    config = PipelineConfig(
        **overrides,
        model=str(folder),
        device="cpu",
        model_impl="transformers",
        max_running_seqs=max_running,
        num_kv_blocks=num_kv_blocks,
        max_model_len=256,
        prefill_chunk_tokens=32,  # the longer prompts prefill in two chunks, and again when recomputed
    )
    return build_llm_engine(Checkpoint(folder), config, device="cpu")


def _run(engine: LLMEngine, prompts: dict[str, list[int]], **params: Any) -> dict[tuple[str, int], SeqOutput]:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    image_token = engine.runner.image_token_id if engine.runner.image_token_id is not None else -1
    for name, ids in prompts.items():
        engine.add(EngineInput(name, ids, image_token, None, sampling))
    merged = run_all(engine, max_steps=2000)  # raises when the engine does not become idle
    assert all(o.finish_reason == "length" for o in merged.values()), merged
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
    return merged


# prefill chunks of several sequences in one forward, and decodes beside short ones (a mixed step)
BATCHED = {"prefill_seqs_per_step": 16, "mixed_chunk_tokens": 64}


@pytest.mark.parametrize("steps", [{}, BATCHED], ids=["one-a-step", "batched"])
@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_preempted_sequences_answer_as_generate(family: str, family_dir: FamilyDir, steps: dict[str, int]) -> None:
    folder = family_dir(family)
    prompts = _prompts(folder)
    reference = _reference(folder)
    expected = {f"p{i}": _generate(reference, ids) for i, ids in enumerate(prompts)}
    # room for the longest answer alone, and for one more block: the sequences must take turns
    blocks = max(blocks_needed(len(p) + MAX_TOKENS, 16) for p in prompts) + 1
    engine = _engine(folder, num_kv_blocks=blocks, **steps)
    outputs = _run(engine, {f"p{i}": ids for i, ids in enumerate(prompts)}, temperature=0.0)
    assert engine.scheduler.num_preemptions > 0
    assert {k[0]: o.token_ids for k, o in outputs.items()} == expected


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_n3_greedy_choices_equal_generate_and_seeded_ones_repeat(family: str, family_dir: FamilyDir) -> None:
    folder = family_dir(family)
    ids = _prompts(folder)[1]
    reference = _reference(folder)
    expected = _generate(reference, ids)
    greedy = _run(_engine(folder, num_kv_blocks=32), {"g": ids}, temperature=0.0, n=3)
    assert sorted(greedy) == [("g", i) for i in range(3)]
    assert all(o.token_ids == expected for o in greedy.values())

    def sampled(seed: int) -> list[list[int]]:
        outputs = _run(_engine(folder, num_kv_blocks=32), {"s": ids}, temperature=1.0, top_k=5, seed=seed, n=3)
        return [outputs[("s", i)].token_ids for i in range(3)]

    first = sampled(7)
    assert sampled(7) == first  # the same seed, the same three answers
    assert len({tuple(c) for c in first}) > 1  # each choice samples with its own generator
    for choice in first:  # every sampled token is one of the model's five most likely after its prefix
        with torch.inference_mode():
            logits = reference(input_ids=torch.tensor([ids + choice])).logits[0, len(ids) - 1 : -1].clone()
            logits[:, reference.generation_config.suppress_tokens] = float("-inf")  # ignore_eos bans them
        top5 = logits.topk(5).indices
        assert all(token in row.tolist() for token, row in zip(choice, top5, strict=True)), choice
