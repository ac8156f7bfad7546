"""The engine process's grammars: one compile per spec, cached, and llguidance while xgrammar compiles."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import xgrammar as xgr

from pipeline.config import PipelineConfig
from pipeline.core.engine_grammars import EngineGrammars
from pipeline.types import GrammarSpec
from sampling.llguidance_matcher import LLGrammar
from vision.checkpoint import Checkpoint

SPEC = GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture
def grammars(checkpoint: Checkpoint) -> EngineGrammars:
    done = threading.Semaphore(0)
    g = EngineGrammars(PipelineConfig(), checkpoint, on_done=done.release)
    g.done = done  # type: ignore[attr-defined]
    return g


def _wait(flight: object) -> object:
    assert isinstance(flight, Future)
    return flight.result(timeout=120).grammar


def test_one_compile_per_spec_then_a_cache_hit(grammars: EngineGrammars) -> None:
    first, second = grammars.get("xgrammar", SPEC), grammars.get("xgrammar", SPEC)
    assert isinstance(first, Future) and first is second
    grammar = _wait(first)
    assert isinstance(grammar, xgr.CompiledGrammar)
    grammars.collect()
    assert grammars.get("xgrammar", SPEC) is grammar
    grammars.close()


def test_xgrammar_asked_for_is_served_by_llguidance_until_its_own_compile_ends(grammars: EngineGrammars) -> None:
    fast = _wait(grammars.get("llguidance", SPEC))
    assert isinstance(fast, LLGrammar)
    grammars.collect()
    assert grammars.get("xgrammar", SPEC) is fast  # its compile started in the background
    for _ in range(2):  # llguidance's compile ended, then xgrammar's
        assert grammars.done.acquire(timeout=120)  # type: ignore[attr-defined]
    grammars.collect()
    assert isinstance(grammars.get("xgrammar", SPEC), xgr.CompiledGrammar)
    grammars.close()


def test_a_failed_compile_fails_its_waiters_and_is_not_cached(grammars: EngineGrammars) -> None:
    bad = GrammarSpec("regex", "(unclosed")
    flight = grammars.get("xgrammar", bad)
    assert isinstance(flight, Future)
    with pytest.raises(Exception, match="regex"):
        flight.result(timeout=120)
    grammars.collect()
    assert grammars.get("xgrammar", bad) is not flight  # tried again, not a cached failure
    grammars.close()
