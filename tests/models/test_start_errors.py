"""A checkpoint we cannot serve fails at start, named: its attention hard-wired past transformers'
``AttentionInterface`` (Bloom's, with ALiBi inside its attention module), or an architecture the
registry has no row for, through ``python -m pipeline serve`` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from sampling.families import FAMILIES, Family
from sampling.hf_adapter import UnsupportedModel
from tests.models.checkpoints import MISTRAL_TEMPLATE, build_tokenizer

BLOOM = "BloomForCausalLM"


@pytest.fixture(scope="module")
def bloom_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Bloom checkpoint: transformers 5 runs its attention in its own module, not through
    the interface."""
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    folder = tmp_path_factory.mktemp("bloom")
    tokenizer = build_tokenizer(
        ["<unk>", "<s>", "</s>"], chat_template=MISTRAL_TEMPLATE, bos="<s>", eos="</s>", unk="<unk>"
    )
    config = BloomConfig(vocab_size=384, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    BloomForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


async def test_a_model_whose_attention_bypasses_the_interface_fails_at_start(
    bloom_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a registry row lets it past the registry, as one added for it would: the adapter must refuse it.
    # The row is added in this process only, so the engine runs here, on its thread
    monkeypatch.setitem(FAMILIES, BLOOM, Family("Bloom"))
    config = PipelineConfig(
        model=str(bloom_dir), device="cpu", max_running_seqs=2, num_kv_blocks=16, max_model_len=64, engine_mode="thread"
    )
    with anyio.fail_after(120), pytest.raises(UnsupportedModel) as caught:
        async with Pipeline(config):
            pass
    message = str(caught.value)
    assert f"architecture {BLOOM}" in message
    assert "does not go through transformers' AttentionInterface" in message
    assert "paged KV cache cannot be plugged into it" in message


def test_serve_names_an_unsupported_architecture_and_exits(bloom_dir: Path) -> None:
    command = [sys.executable, "-m", "pipeline", "serve", "--model", str(bloom_dir), "--port", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: architecture {BLOOM} is not supported: it has no row in the model registry")
    assert "supported: " in last and "LlamaForCausalLM" in last
