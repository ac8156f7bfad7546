"""One model runner and compiler for the engine tests; each test gets a fresh engine over them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import xgrammar as xgr

from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.model_runner import ModelRunner
from vision.checkpoint import Checkpoint

NUM_BLOCKS = 256


@pytest.fixture(scope="session")
def runner(checkpoint: Checkpoint) -> ModelRunner:
    return ModelRunner(checkpoint, device="cpu", max_model_len=4096, num_blocks=NUM_BLOCKS, block_size=16)


@pytest.fixture(scope="session")
def compiler(tokenizer_info: Any) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(tokenizer_info)


@pytest.fixture(scope="session")
def token_bytes(checkpoint: Checkpoint) -> TokenBytes:
    return TokenBytes.from_tokenizer(checkpoint.tokenizer_info, checkpoint.tokenizer)


@pytest.fixture
def engine(runner: ModelRunner, token_bytes: TokenBytes) -> Iterator[LLMEngine]:
    eng = LLMEngine(runner, token_bytes, eos_token_ids=[2], num_blocks=NUM_BLOCKS, max_running=16, record_timeline=True)
    yield eng
    # every test must leave the shared KV cache empty
    assert eng.scheduler.allocator.num_free == NUM_BLOCKS
    assert not eng.has_work()
