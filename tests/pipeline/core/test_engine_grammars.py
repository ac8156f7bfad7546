"""The engine process's grammars: a verdict per hint (the stage's backend policy and cache: a verdict on a
cached stand-in, the spec's second use, starts xgrammar's compile), refusals typed for the serving
process's 400, and adds served from the same cache."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import xgrammar as xgr

from pipeline.config import PipelineConfig
from pipeline.engine.grammars import EngineGrammars
from pipeline.engine.wire import GrammarsIdle, GrammarVerdict
from pipeline.types import GrammarSpec
from sampling.guided.llguidance.matcher import LLGrammar
from stages.grammar.types import FIRST_USE
from vision.checkpoint import Checkpoint

SPEC = GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture
def sent() -> queue.Queue[Any]:
    return queue.Queue()


@pytest.fixture
def grammars(checkpoint: Checkpoint, sent: queue.Queue[Any]) -> Iterator[EngineGrammars]:
    g = EngineGrammars(PipelineConfig(), checkpoint, send=sent.put, on_done=lambda: None)
    yield g
    g.close()


def test_llguidance_answers_the_first_use_and_the_second_starts_xgrammar_which_replaces_it(
    grammars: EngineGrammars, sent: queue.Queue[Any]
) -> None:
    grammars.verdict(1, SPEC)
    first = sent.get(timeout=120)
    assert isinstance(first, GrammarVerdict) and first.token == 1 and first.error is None
    assert (first.backend, first.reason, first.is_stand_in) == ("llguidance", FIRST_USE, True)
    assert isinstance(grammars.cached(SPEC), LLGrammar)
    # the request's add (here one that, sent before its verdict, compiles after it: a hit) is no
    # second use: it starts no xgrammar compile
    assert grammars.get(SPEC).result(timeout=120).is_stand_in
    grammars.idle(2)
    assert sent.get(timeout=120) == GrammarsIdle(2)  # nothing told unasked: no compile ran
    assert grammars.stage.stats.backends == {f"llguidance: {FIRST_USE}": 1}
    # the serving process asks again on a hit of its cached stand-in: the spec's second use
    grammars.verdict(3, SPEC)
    second = sent.get(timeout=120)
    assert (second.token, second.backend, second.is_stand_in) == (3, "llguidance", True)
    grammars.idle(4)
    replaced, idle = sorted((sent.get(timeout=120), sent.get(timeout=120)), key=lambda m: type(m).__name__)
    assert idle == GrammarsIdle(4)  # xgrammar's background compile has ended
    assert isinstance(grammars.cached(SPEC), xgr.CompiledGrammar)
    # and the serving process is told unasked, so that its later hits need not ask
    assert isinstance(replaced, GrammarVerdict) and (replaced.token, replaced.key) == (0, SPEC.key)
    assert (replaced.backend, replaced.is_stand_in) == ("xgrammar", False)
    grammars.verdict(5, SPEC)
    again = sent.get(timeout=120)
    assert (again.backend, again.is_stand_in) == ("xgrammar", False)
    assert again.compiles == {f"llguidance: {FIRST_USE}": 1, "xgrammar: replaces the llguidance stand-in": 1}
    assert grammars.get(SPEC).result(timeout=120).grammar is grammars.cached(SPEC)  # a hit: no compile
    assert sent.empty()


def test_a_refused_spec_is_a_typed_verdict_naming_its_field(grammars: EngineGrammars, sent: queue.Queue[Any]) -> None:
    bad = GrammarSpec("regex", "(unclosed", field="guided_regex")
    grammars.verdict(7, bad)
    verdict = sent.get(timeout=120)
    assert isinstance(verdict, GrammarVerdict) and verdict.error is not None
    name, message, field, _ = verdict.error
    assert (name, field) == ("GrammarError", "guided_regex") and "regex" in message
    assert grammars.cached(bad) is None
    with pytest.raises(Exception, match="regex"):
        grammars.get(bad).result(timeout=120)  # the cached refusal, raised again


def _named(name: str) -> GrammarSpec:
    return GrammarSpec("json_schema", {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]})


def test_an_add_that_finds_its_grammar_counts_as_a_use_of_the_cache(
    checkpoint: Checkpoint, sent: queue.Queue[Any]
) -> None:
    """A spec the serving process keeps using reaches the engine only in adds once it has its verdict:
    new specs evict the least recently used grammar, not the one in use (as hits do in thread mode)."""
    config = PipelineConfig(grammar_backend="llguidance")
    grammars = EngineGrammars(config, checkpoint, send=sent.put, on_done=lambda: None)
    try:
        specs = [_named(f"p{i}") for i in range(5)]  # one grammar size: llguidance's estimate of equal texts
        grammars.verdict(1, specs[0])
        assert sent.get(timeout=120).error is None
        size = grammars.stage.cached_bytes
        grammars.stage._cache.max_bytes = 4 * size + size // 2  # room for four
        for token, spec in enumerate(specs[1:4], 2):
            grammars.verdict(token, spec)
            assert sent.get(timeout=120).error is None
        assert grammars.cached(specs[0]) is not None  # an add of the oldest spec
        grammars.verdict(5, specs[4])
        assert sent.get(timeout=120).error is None
        assert [grammars.stage.lookup(spec) is not None for spec in specs] == [True, False, True, True, True]
    finally:
        grammars.close()


@pytest.fixture
def llguidance_grammars(checkpoint: Checkpoint, sent: queue.Queue[Any]) -> Iterator[EngineGrammars]:
    g = EngineGrammars(PipelineConfig(grammar_backend="llguidance"), checkpoint, send=sent.put, on_done=lambda: None)
    yield g
    g.close()


def test_the_decode_loop_hands_work_over_without_waiting_for_the_stages_loop(
    llguidance_grammars: EngineGrammars, sent: queue.Queue[Any]
) -> None:
    """The decode loop's calls return while the stage's loop cannot run (a portal's calls wait for it,
    a wake-up of another thread per guided add); what they asked for is done once it runs again."""
    grammars = llguidance_grammars  # one backend: a hit starts no background compile
    grammars.verdict(1, SPEC)
    assert sent.get(timeout=120).error is None
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(timeout=120)

    grammars._post(hold)
    assert entered.wait(timeout=120)
    asked: dict[str, Any] = {}

    def decode_loop() -> None:
        asked["cached"] = grammars.cached(SPEC)
        grammars.verdict(2, SPEC)
        asked["get"] = grammars.get(SPEC)
        grammars.idle(3)

    caller = threading.Thread(target=decode_loop)
    caller.start()
    caller.join(timeout=60)  # against a hang: the calls would wait as long as the stage's loop is held
    held = caller.is_alive()
    release.set()
    caller.join(timeout=120)
    assert not held, "a call from the decode loop waited for the stage's loop"
    assert isinstance(asked["cached"], LLGrammar)
    assert asked["get"].result(timeout=120).grammar is asked["cached"]
    answers = sorted((sent.get(timeout=120), sent.get(timeout=120)), key=lambda m: type(m).__name__)
    assert isinstance(answers[0], GrammarVerdict) and answers[0].token == 2 and answers[0].error is None
    assert answers[1] == GrammarsIdle(3)
