"""CUDA paths: bf16 model, pinned bitmask, side-stream copies, the one-step-ahead loop, decode buffers.
Skipped without a GPU."""

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
from tests.sampling.helpers import add, make_engine, prompt, reference_logits, run_all
from vision.checkpoint import Checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_host_copier_returns_the_device_ids() -> None:
    ids = torch.arange(7, device="cuda") * 3
    wait = HostCopier(torch.device("cuda"), 16).start(ids)
    assert wait() == [0, 3, 6, 9, 12, 15, 18]


@pytest.fixture(scope="module")
def cuda_runner(checkpoint: Checkpoint) -> ModelRunner:
    return ModelRunner(checkpoint, device="cuda", max_model_len=2048, num_blocks=128, block_size=16)


def test_the_bf16_decoder_on_cuda_matches_transformers_in_fp32(cuda_runner: ModelRunner, reference: Any) -> None:
    """Prefill, then decode steps across a block boundary (their keys padded to whole blocks), within
    bf16's error of transformers' fp32 model on the CPU: ||ours - ref|| / ||ref|| per position."""
    seq = torch.randint(20, 131_072, (40,), generator=torch.Generator().manual_seed(0))
    expected = reference_logits(reference, seq)
    table = [5, 9, 3]

    def relative_error(logits: torch.Tensor, position: int) -> float:
        return float((logits.cpu() - expected[position]).norm() / expected[position].norm())

    assert relative_error(cuda_runner.prefill(seq[:30].tolist(), 0, table, None)[0], 29) < 2e-2
    for position in range(30, 40):
        batch = cuda_runner.decode_inputs([position], [table])
        assert relative_error(cuda_runner.decode([int(seq[position])], batch)[0], position) < 2e-2


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_guided_decoding_on_cuda_validates(
    cuda_runner: ModelRunner,
    token_bytes: TokenBytes,
    compiler: xgr.GrammarCompiler,
    hf_tokenizer: Any,
    one_step_ahead: bool,
) -> None:
    assert cuda_runner.dtype == torch.bfloat16
    engine = make_engine(cuda_runner, token_bytes, num_blocks=128, max_running=8, one_step_ahead=one_step_ahead)
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    for i in range(4):
        add(engine, f"g{i}", prompt(hf_tokenizer, f"gpu {i}"), grammar, max_tokens=32, temperature=0.8, seed=i)
    for out in run_all(engine).values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_one_step_ahead_on_cuda_gives_the_synchronous_tokens(
    cuda_runner: ModelRunner, token_bytes: TokenBytes, hf_tokenizer: Any
) -> None:
    """Sequences that end by length leave both loops at the same step, so both run the same batches
    (the same kernels, the same rounding in bf16) and must give the same tokens."""
    outputs = []
    for one_step_ahead in (False, True):
        engine = make_engine(cuda_runner, token_bytes, num_blocks=128, max_running=8, one_step_ahead=one_step_ahead)
        for i in range(6):
            params: dict[str, Any] = {"temperature": 0.0} if i % 2 else {"temperature": 0.8, "top_p": 0.9, "seed": i}
            add(engine, f"r{i}", prompt(hf_tokenizer, f"gpu {i}"), max_tokens=8 + 5 * i, ignore_eos=True, **params)
        outputs.append({k: o.token_ids for k, o in run_all(engine).items()})
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_decode_buffers_on_cuda(
    cuda_runner: ModelRunner,
    token_bytes: TokenBytes,
    compiler: xgr.GrammarCompiler,
    hf_tokenizer: Any,
    one_step_ahead: bool,
) -> None:
    """The padded, buffered step on CUDA (its inputs copied from pinned memory): the same logits as the
    step built at its size within bf16's rounding (a padded matrix product may take another kernel),
    guided answers that validate, and buffers that never move."""
    from sampling.decode_buffers import DecodeBuffers

    buffers = DecodeBuffers(
        max_rows=16, max_model_len=2048, block_size=16, pad_block=cuda_runner.pad_block, device=cuda_runner.device
    )
    address = buffers.inputs.data_ptr()
    tables = [[10 + 3 * row, 11 + 3 * row, 12 + 3 * row] for row in range(5)]
    positions = [20 + 4 * row for row in range(5)]
    for table, length in zip(tables, positions, strict=True):
        cuda_runner.prefill(list(range(100, 100 + length)), 0, table, None)
    ids = list(range(300, 305))
    with torch.inference_mode():
        expected = cuda_runner.decode(ids, cuda_runner.decode_inputs(positions, tables))
        padded = cuda_runner.decode(*buffers.view(buffers.load(ids, positions, tables)))[:5]
    assert float((padded - expected).norm() / expected.norm()) < 2e-2
    engine = make_engine(
        cuda_runner, token_bytes, num_blocks=128, max_running=8, one_step_ahead=one_step_ahead, decode_buffers=True
    )
    assert engine.parts.buffers is not None
    engine_address = engine.parts.buffers.inputs.data_ptr()
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    for i in range(5):  # 5 rows: padded to 8
        add(engine, f"b{i}", prompt(hf_tokenizer, f"gpu {i}"), grammar, max_tokens=32, temperature=0.8, seed=i)
    for out in run_all(engine).values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert buffers.inputs.data_ptr() == address and engine.parts.buffers.inputs.data_ptr() == engine_address
