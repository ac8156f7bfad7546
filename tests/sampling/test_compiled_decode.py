"""The decode forward compiled with torch.compile (inductor) computes what the eager one does.

Both runners: the hand-written decoder through the engine (greedy, seeded, guided, with preemption
and prefix-cache hits) and the adapter over transformers' classes at the runner level. The first
test of each runner pays inductor's compile (seconds; cached on disk for the next run).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config import PipelineConfig
from pipeline.engine.factory import build_llm_engine
from pipeline.types import GrammarSpec
from sampling.compiled import num_compiled_graphs, use_inductor_cache
from sampling.decode_buffers import DecodeBuffers
from sampling.detokenizer import TokenBytes
from sampling.hf_adapter import HFModelRunner
from sampling.model_runner import ModelRunner
from sampling.paged_runner import PagedRunner
from tests.sampling.helpers import NUM_BLOCKS, NUM_TIGHT_BLOCKS, SCHEMA, make_engine, two_rounds_tokens
from tests.serve_flags import config_of
from vision.checkpoint import Checkpoint

ATOL = 1e-4
# inductor's CPU kernels are C++: a machine without a compiler cannot build them
needs_compiler = pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if cxx),
    reason="needs a C++ compiler (inductor builds its CPU kernels with one)",
)


@pytest.fixture(scope="module")
def compiled_runner(checkpoint: Checkpoint) -> ModelRunner:
    runner = ModelRunner(checkpoint, device="cpu", max_model_len=4096, num_blocks=NUM_BLOCKS, block_size=16)
    runner.compile_decode()
    return runner


def _tokens(runner: PagedRunner, token_bytes: TokenBytes, tokenizer: Any, grammar: Any) -> dict[str, list[int]]:
    """``two_rounds_tokens`` on ``runner``: preemptions, then prefix hits."""
    engine = make_engine(runner, token_bytes, num_blocks=NUM_TIGHT_BLOCKS, max_running=8)  # type: ignore[arg-type]
    return two_rounds_tokens(engine, tokenizer, grammar)


@needs_compiler
@pytest.mark.slow  # the first compile: about 20 s with an empty inductor cache, 3 s with a warm one
def test_compiled_decode_gives_the_eager_tokens(
    runner: ModelRunner,
    compiled_runner: ModelRunner,
    token_bytes: TokenBytes,
    hf_tokenizer: Any,
    grammar_compilers: tuple[Any, Any],
) -> None:
    grammar = grammar_compilers[0].compile(GrammarSpec("json_schema", SCHEMA)).grammar  # xgrammar
    eager = _tokens(runner, token_bytes, hf_tokenizer, grammar)
    assert _tokens(compiled_runner, token_bytes, hf_tokenizer, grammar) == eager


def _decode_both(eager: PagedRunner, compiled: PagedRunner, shapes: list[tuple[int, int]]) -> None:
    """Decode ``(batch size, first position)`` steps on both runners, each row after the same prefill
    of its own blocks on both; their logits agree."""
    gen = torch.Generator().manual_seed(0)
    for size, first in shapes:
        tables = [list(range(row * 8, row * 8 + 8)) for row in range(size)]
        positions = [first + 3 * row for row in range(size)]  # rows of different lengths
        for table, length in zip(tables, positions, strict=True):
            seq = torch.randint(20, eager.cfg.vocab_size, (length,), generator=gen).tolist()
            eager.prefill(seq, 0, table, None)
            compiled.prefill(seq, 0, table, None)
        ids = torch.randint(0, eager.cfg.vocab_size, (size,), generator=gen)
        expected = eager.decode(ids, eager.decode_inputs(positions, tables))
        actual = compiled.decode(ids, compiled.decode_inputs(positions, tables))
        torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@needs_compiler
def test_any_batch_size_and_length_shares_one_graph(runner: ModelRunner, compiled_runner: ModelRunner) -> None:
    """Every B, 1 included, and every key length run on one graph; the padded steps of decode
    buffers run on it too."""
    _decode_both(runner, compiled_runner, [(1, 3), (2, 20), (3, 40), (1, 70), (5, 17), (8, 90), (13, 5), (2, 100)])
    assert num_compiled_graphs(ModelRunner) == 1
    buffers = DecodeBuffers(
        max_rows=16, max_model_len=4096, block_size=16, pad_block=compiled_runner.pad_block, device=runner.device
    )
    for size, first in [(1, 3), (3, 40), (5, 17), (13, 5)]:  # the rows prefilled above: 1, 4, 8 and 16 padded
        tables = [list(range(row * 8, row * 8 + 8)) for row in range(size)]
        positions = [first + 3 * row for row in range(size)]
        ids = list(range(100, 100 + size))
        expected = runner.decode(ids, runner.decode_inputs(positions, tables))
        with torch.inference_mode():
            padded = compiled_runner.decode(*buffers.view(buffers.load(ids, positions, tables)))
        torch.testing.assert_close(padded[:size], expected, atol=ATOL, rtol=0)
    assert num_compiled_graphs(ModelRunner) == 1


@needs_compiler
@pytest.mark.slow  # its compile: about 18 s with an empty inductor cache, 2 s with a warm one
def test_the_adapter_compiled_gives_the_eager_logits(checkpoint: Checkpoint) -> None:
    """The adapter's decode forward (transformers' Mistral classes) traced whole around the opaque
    attention: batched decode steps over prefilled sequences of different lengths."""
    runners = [
        HFModelRunner(checkpoint, device="cpu", max_model_len=1024, num_blocks=64, block_size=16) for _ in range(2)
    ]
    runners[1].compile_decode()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(20, 131_072, (n,), generator=gen).tolist() for n in (21, 9, 40)]
    tables = [[5, 9, 3], [7, 1], [4, 11, 12]]
    for r in runners:
        for seq, table in zip(seqs, tables, strict=True):
            r.prefill(seq[:-4], 0, table, None)
    for step in range(4):
        positions = [len(s) - 4 + step for s in seqs]
        ids = [s[p] for s, p in zip(seqs, positions, strict=True)]
        eager, compiled = (r.decode(ids, r.decode_inputs(positions, tables)) for r in runners)
        torch.testing.assert_close(compiled, eager, atol=ATOL, rtol=0)
        assert compiled.argmax(-1).tolist() == eager.argmax(-1).tolist()
    assert num_compiled_graphs(HFModelRunner) == 1  # the graph of every B


def test_inductor_cache_goes_under_the_cache_dir_unless_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_inductor_cache(tmp_path) == tmp_path / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch writes there itself
    assert use_inductor_cache(tmp_path) == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert use_inductor_cache(tmp_path) == tmp_path / "elsewhere"


@needs_compiler
def test_compile_model_on_compiles_the_engine_s_forward_at_its_start(
    checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    os.makedirs(default_cache_dir(), exist_ok=True)
    (tmp_path / "inductor").symlink_to(default_cache_dir(), target_is_directory=True)  # the warm cache of this test run
    warm_ups = []
    warm_up = PagedRunner.warm_up_decode
    monkeypatch.setattr(PagedRunner, "warm_up_decode", lambda runner: warm_ups.append(warm_up(runner)))
    # the compiled_runner fixture's shapes: its graphs serve this runner too
    config = PipelineConfig(
        compile_model="on", cache_dir=tmp_path, max_model_len=4096, num_kv_blocks=NUM_BLOCKS, max_running_seqs=2
    )
    engine = build_llm_engine(checkpoint, config, device="cpu")
    assert engine.runner.compiled_decode is not None and len(warm_ups) == 1
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert num_compiled_graphs(ModelRunner) == 1  # ready before any request, the one every step runs on
    off = build_llm_engine(checkpoint, dataclasses.replace(config, compile_model="auto"), device="cpu")
    assert off.runner.compiled_decode is None
    with pytest.raises(ValueError, match="compile_model"):
        PipelineConfig(compile_model="yes")


@pytest.mark.parametrize(("flags", "mode"), [([], "auto"), (["--compile"], "on"), (["--no-compile"], "off")])
def test_serve_compile_flags_reach_the_config(flags: list[str], mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_of(flags, monkeypatch).compile_model == mode


@pytest.mark.parametrize(("flags", "on"), [([], False), (["--decode-buffers"], True)])
def test_the_decode_buffers_flag_reaches_the_config(
    flags: list[str], on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert config_of(flags, monkeypatch).decode_buffers is on
