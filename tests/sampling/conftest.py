"""One model runner and one grammar compiler per session; each test builds fresh engines over them.

The runner owns the KV cache, so every engine a test builds must give all its blocks back: the
``new_engine`` factory checks that when the test ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import xgrammar as xgr

from pipeline.types import GrammarSpec
from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.model_runner import ModelRunner
from tests.sampling.helpers import NUM_BLOCKS, SCHEMA, make_engine
from vision.checkpoint import Checkpoint

NewEngine = Callable[..., LLMEngine]


@pytest.fixture(scope="session")
def runner(checkpoint: Checkpoint) -> ModelRunner:
    return ModelRunner(checkpoint, device="cpu", max_model_len=4096, num_blocks=NUM_BLOCKS, block_size=16)


@pytest.fixture(scope="session")
def reference(checkpoint: Checkpoint) -> Any:
    """transformers' own model of the checkpoint, that the runners' logits are checked against."""
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(checkpoint.path).eval()


@pytest.fixture(scope="session")
def compiler(tokenizer_info: Any) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(tokenizer_info)


# Modules whose tests take a grammar as one more request property (log probabilities, the prefix
# cache): the default backend is enough there. Elsewhere (the step loops: batch fill, n > 1 forks,
# aborts, preemption, the lazy greedy path, one step ahead) the matcher is the subject, and every
# test runs with both backends' matchers.
GRAMMAR_INCIDENTAL = ("tests.sampling.test_logits_process", "tests.sampling.test_prefix_cache")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "json_grammar" in metafunc.fixturenames:
        incidental = metafunc.module.__name__ in GRAMMAR_INCIDENTAL
        backends = ["xgrammar"] if incidental else ["xgrammar", "llguidance"]
        metafunc.parametrize("json_grammar", backends, indirect=True, scope="module")


@pytest.fixture(scope="module")
def json_grammar(request: pytest.FixtureRequest, grammar_compilers: tuple[Any, Any]) -> Any:
    """SCHEMA compiled by the backend the test is parametrized with (``pytest_generate_tests``)."""
    compiler = dict(zip(("xgrammar", "llguidance"), grammar_compilers, strict=True))[request.param]
    return compiler.compile(GrammarSpec("json_schema", SCHEMA)).grammar


@pytest.fixture(scope="session")
def token_bytes(checkpoint: Checkpoint) -> TokenBytes:
    return TokenBytes.from_tokenizer(checkpoint.tokenizer_info, checkpoint.tokenizer)


@pytest.fixture
def new_engine(runner: ModelRunner, token_bytes: TokenBytes) -> Iterator[NewEngine]:
    """``new_engine(num_blocks=..., max_running=..., ...)``: a fresh engine over the shared runner."""
    engines: list[LLMEngine] = []

    def build(**overrides: Any) -> LLMEngine:
        engine = make_engine(runner, token_bytes, **({"record_timeline": True} | overrides))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:  # every test leaves the shared KV cache empty and the engine idle
        assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
        assert not engine.has_work() and engine.num_requests == 0


@pytest.fixture
def engine(new_engine: NewEngine) -> LLMEngine:
    return new_engine()
