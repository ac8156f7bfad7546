"""Text families through the adapter: Llama 3.1 (``llama3`` RoPE scaling), Qwen3 (qk-norm), Qwen2
(q/k/v biases), Gemma 2 (sliding windows, soft-capping), Gemma 3 (sliding windows with their own
RoPE, qk-norm) and Mistral, each served through ``Pipeline.submit()`` with greedy answers equal to transformers' own
``generate`` on the same rendered prompt, logits within 1e-4, and a guided answer that validates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from sampling.families import build_runner
from sampling.hf_adapter import HFModelRunner, UnsupportedModel
from vision.checkpoint import Checkpoint

FamilyDir = Callable[[str], Path]
TEXT_FAMILIES = ["llama3.1", "qwen3", "qwen2", "gemma2", "gemma3", "mistral"]
ATOL = 1e-4
MESSAGES = [{"role": "user", "content": "Describe the quick brown fox in one sentence, please."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def _config(folder: Path, **overrides: Any) -> PipelineConfig:
    kwargs: dict[str, Any] = {
        "device": "cpu",
        "max_running_seqs": 4,
        "num_kv_blocks": 64,
        "max_model_len": 512,
        "engine_mode": "thread",
    }
    return PipelineConfig(model=str(folder), **{**kwargs, **overrides})


def _reference(folder: Path, **config_overrides: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, **config_overrides)
    return AutoModelForCausalLM.from_pretrained(folder, config=config).eval()


def _generate(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return list(out[0, len(ids) :].tolist())


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_logits_match_transformers(family: str, family_dir: FamilyDir) -> None:
    """Chunked prefill, a decode batch of different lengths, and a prefix-cache hit."""
    folder = family_dir(family)
    reference = _reference(folder)
    runner = HFModelRunner(Checkpoint(folder), device="cpu", max_model_len=512, num_blocks=32, block_size=16)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(10, 360, (n,), generator=gen) for n in (40, 23)]
    with torch.inference_mode():
        expected = [reference(input_ids=s[None]).logits[0] for s in seqs]
    tables = [[5, 9, 3], [7, 1]]
    for start, end in [(0, 7), (7, 17), (17, 30)]:
        logits = runner.prefill(seqs[0][start:end].tolist(), start, tables[0], None)
        torch.testing.assert_close(logits[0], expected[0][end - 1], atol=ATOL, rtol=0)
    runner.prefill(seqs[1][:13].tolist(), 0, tables[1], None)
    for step in range(5):
        positions = [30 + step, 13 + step]
        logits = runner.decode(
            [int(s[p]) for s, p in zip(seqs, positions, strict=True)], runner.decode_inputs(positions, tables)
        )
        for row in range(2):
            torch.testing.assert_close(logits[row], expected[row][positions[row]], atol=ATOL, rtol=0)
    # a third sequence whose first block is the first one's (a prefix-cache hit)
    third = torch.cat([seqs[0][:16], seqs[1][:7]])
    logits = runner.prefill(third[16:].tolist(), 16, [5, 12], None)
    with torch.inference_mode():
        torch.testing.assert_close(logits[0], reference(input_ids=third[None]).logits[0, -1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("family", "impl"), [*((f, "transformers") for f in TEXT_FAMILIES), ("mistral", "native"), ("llama3.1", "auto")]
)
async def test_served_answers_equal_generate_and_guided_answers_validate(
    family: str, impl: str, family_dir: FamilyDir
) -> None:
    folder = family_dir(family)
    tokenizer = Checkpoint(folder).tokenizer
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    expected = _generate(_reference(folder), prompt, 16)
    assert len(expected) > 8  # a real answer, not an end of turn at once
    guided = {
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
    }
    with anyio.fail_after(180):
        async with Pipeline(_config(folder, model_impl=impl)) as pipe:
            answer = await (await pipe.submit({"messages": MESSAGES, "max_tokens": 16, "temperature": 0})).result()
            structured = await (await pipe.submit(guided)).result()
    assert answer.token_ids == expected
    assert structured.finish_reason == "stop"
    jsonschema.validate(json.loads(structured.text), SCHEMA)


@pytest.mark.parametrize(
    ("family", "without_feature"),
    [
        ("llama3.1", {"rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}}),
        ("gemma3", {"sliding_window": 4096}),
        ("gemma2", {"sliding_window": 4096}),
        ("gemma2", {"attn_logit_softcapping": None}),  # the final cap keeps the argmax: the logits test has it
    ],
)
def test_the_family_feature_changes_the_greedy_tokens(
    family: str, without_feature: dict[str, Any], family_dir: FamilyDir
) -> None:
    """The tiny weights are strong enough that serving without the family's feature would show."""
    folder = family_dir(family)
    prompt = Checkpoint(folder).tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert _generate(_reference(folder), prompt, 16) != _generate(_reference(folder, **without_feature), prompt, 16)


def test_qwen2_without_biases_would_answer_otherwise(family_dir: FamilyDir) -> None:
    folder = family_dir("qwen2")
    prompt = Checkpoint(folder).tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    reference, ablated = _reference(folder), _reference(folder)
    with torch.no_grad():
        for layer in ablated.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert _generate(reference, prompt, 16) != _generate(ablated, prompt, 16)


def test_qwen3_without_qk_norm_would_answer_otherwise(family_dir: FamilyDir) -> None:
    folder = family_dir("qwen3")
    prompt = Checkpoint(folder).tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    reference, ablated = _reference(folder), _reference(folder)
    for layer in ablated.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
    assert _generate(reference, prompt, 16) != _generate(ablated, prompt, 16)


@pytest.mark.parametrize("family", ["llama3.1", "qwen3", "qwen2", "gemma3"])
def test_auto_picks_the_adapter_where_the_native_decoder_cannot(family: str, family_dir: FamilyDir) -> None:
    checkpoint = Checkpoint(family_dir(family))
    runner = build_runner(checkpoint, device="cpu", max_model_len=64, num_blocks=4, block_size=16)
    assert isinstance(runner, HFModelRunner)
    with pytest.raises(UnsupportedModel, match="native decoder cannot run"):
        build_runner(checkpoint, impl="native", device="cpu", max_model_len=64, num_blocks=4, block_size=16)


async def test_an_unsupported_architecture_fails_at_start_naming_it(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedModel, match="architecture GPT2LMHeadModel is not supported.*registry"):
        async with Pipeline(_config(tmp_path)):
            pass
