"""The language model in another dtype (``PipelineConfig.dtype``): in bfloat16 both runners compute
what transformers' own model computes in bfloat16, and an engine answers as its ``generate`` does."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pipeline.config import PipelineConfig
from pipeline.engine.factory import build_llm_engine
from sampling.hf_adapter import HFModelRunner
from sampling.inputs import EngineInput
from sampling.model_runner import ModelRunner
from sampling.params import SamplingParams
from tests.sampling.helpers import IMAGE_TOKEN, prompt, run_all
from tests.serve_flags import config_of
from vision.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def reference_bf16(checkpoint: Checkpoint) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("kind", [ModelRunner, HFModelRunner], ids=["hand-written", "transformers"])
@torch.inference_mode()
def test_bf16_runners_give_transformers_bf16_logits(
    checkpoint: Checkpoint, reference_bf16: Any, kind: type[ModelRunner] | type[HFModelRunner]
) -> None:
    runner = kind(checkpoint, device="cpu", max_model_len=256, num_blocks=16, block_size=16, dtype=torch.bfloat16)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    ids = torch.randint(20, 131_072, (40,), generator=torch.Generator().manual_seed(0))
    expected = reference_bf16(input_ids=ids[None]).logits[0].float()  # [40, vocab]
    logits = [runner.prefill(ids[:37].tolist(), 0, [3, 1, 2], None)[0]]
    for position in range(37, 40):  # then decode steps, the rest of the sequence
        logits.append(runner.decode([int(ids[position])], runner.decode_inputs([position], [[3, 1, 2]]))[0])
    torch.testing.assert_close(logits[0], expected[36], atol=1e-6, rtol=0)  # the same forward: the same bits
    # a decode step attends over the cached K/V with one query, transformers over the whole sequence:
    # they may round apart by one bf16 step (2^-8 at these logits' size, under 1)
    assert float(expected.abs().max()) < 1
    torch.testing.assert_close(torch.stack(logits[1:]), expected[37:], atol=2**-8, rtol=0)
    assert torch.stack(logits).argmax(-1).tolist() == expected[36:].argmax(-1).tolist()
    assert logits[0].dtype == torch.float32  # sampling sees fp32 logits whatever the weights


def test_a_bf16_engine_answers_as_transformers_generate_does(
    checkpoint: Checkpoint, reference_bf16: Any, hf_tokenizer: Any
) -> None:
    config = PipelineConfig(dtype="bfloat16", max_model_len=512, num_kv_blocks=32)
    engine = build_llm_engine(checkpoint, config, device="cpu")
    assert engine.runner.dtype == torch.bfloat16
    ids = prompt(hf_tokenizer, "say something")
    engine.add(EngineInput("r", ids, IMAGE_TOKEN, None, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    answer = run_all(engine)[("r", 0)].token_ids
    with torch.inference_mode():
        out = reference_bf16.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert answer == out[0, len(ids) :].tolist()
    fp32 = build_llm_engine(checkpoint, dataclasses.replace(config, dtype="auto"), device="cpu")
    assert fp32.runner.dtype == torch.float32  # auto on the CPU


def test_an_unknown_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="PipelineConfig.dtype"):
        PipelineConfig(dtype="bf16")


@pytest.mark.parametrize(("flags", "dtype"), [([], "auto"), (["--dtype", "bfloat16"], "bfloat16")])
def test_the_dtype_flag_reaches_the_config(flags: list[str], dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_of(flags, monkeypatch).dtype == dtype
