"""Random-weight checkpoints of released shapes: their sizes, and a shrunk one served end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from pipeline.config import PipelineConfig
from pipeline.engine.factory import build_llm_engine
from sampling.inputs import EngineInput
from sampling.params import SamplingParams
from vision.checkpoint import open_checkpoint
from vision.default_checkpoint import EMBEDDED_SHAPE, pixtral_config, write_pixtral_checkpoint
from vision.sized_checkpoint import PRESETS

# the embedded shape with a wider decoder (head_dim 128, as the presets have), a shorter tower
SHRUNK = dataclasses.replace(
    EMBEDDED_SHAPE, hidden=128, head_dim=128, intermediate=256, max_positions=4096, vision_layers=1, image_size=256
)


@pytest.mark.parametrize(("name", "count"), [("pixtral-7b", 8_477_799_424), ("pixtral-12b", 12_682_739_712)])
def test_presets_have_their_released_sizes(name: str, count: int) -> None:
    with torch.device("meta"):  # shapes only: nothing allocated
        model = LlavaForConditionalGeneration(pixtral_config(PRESETS[name]))
    assert sum(p.numel() for p in model.parameters()) == count


def test_a_written_checkpoint_is_served(tmp_path: Path) -> None:
    folder = tmp_path / "shrunk"
    count = write_pixtral_checkpoint(folder, SHRUNK, seed=3, dtype=torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["text_config"]["hidden_size"] == 128
    checkpoint = open_checkpoint(str(folder), tmp_path / "cache")
    assert sum(t.numel() for t in checkpoint.load_weights(("",)).values()) == count

    engine = build_llm_engine(checkpoint, PipelineConfig(max_running_seqs=2, max_model_len=256), device="cpu")
    prompt = checkpoint.tokenizer.encode("[INST]hello[/INST]", add_special_tokens=False)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add(EngineInput("r", prompt, 10, None, params, None))
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
    assert len(tokens) == 5 and all(0 <= t < 131_072 for t in tokens)
