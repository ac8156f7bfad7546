"""CUDA paths: bf16 model, pinned bitmask, side-stream copies. Skipped without a GPU."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from sampling.detokenizer import TokenBytes
from sampling.model_runner import ModelRunner
from sampling.overlap import HostCopier
from tests.sampling.helpers import add, make_engine, prompt, run_all
from vision.checkpoint import Checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_host_copier_returns_the_device_ids() -> None:
    ids = torch.arange(7, device="cuda") * 3
    wait = HostCopier(torch.device("cuda"), 16).start(ids)
    assert wait() == [0, 3, 6, 9, 12, 15, 18]


def test_guided_decoding_on_cuda_validates(
    checkpoint: Checkpoint, token_bytes: TokenBytes, compiler: xgr.GrammarCompiler, hf_tokenizer: Any
) -> None:
    runner = ModelRunner(checkpoint, device="cuda", max_model_len=2048, num_blocks=128, block_size=16)
    assert runner.dtype == torch.bfloat16
    engine = make_engine(runner, token_bytes, num_blocks=128, max_running=8)
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    for i in range(4):
        add(engine, f"g{i}", prompt(hf_tokenizer, f"gpu {i}"), grammar, max_tokens=32, temperature=0.8, seed=i)
    for out in run_all(engine).values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
