"""The engine's step timeline: each step's kind, tokens, sequences and start, in order."""

from __future__ import annotations

from typing import Any

from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import add, prompt, run_all


def test_each_step_records_its_kind_tokens_sequences_and_start(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    engine = new_engine(chunk_tokens=8)
    ids = prompt(hf_tokenizer, "a prompt that is long enough to be prefilled in three chunks of eight tokens")
    assert 16 < len(ids) <= 24
    add(engine, "r", ids, max_tokens=3, temperature=0.0, ignore_eos=True)
    run_all(engine)
    steps = [(t.kind, t.tokens, t.batch) for t in engine.timeline]
    # two chunks that sample nothing, the last chunk (samples the first token), two decodes of one
    assert steps == [("prefill", 8, 0), ("prefill", 8, 0), ("prefill", len(ids) - 16, 1)] + [("decode", 1, 1)] * 2
    starts = [t.start for t in engine.timeline]
    assert all(a + t.total <= b for a, b, t in zip(starts, starts[1:], engine.timeline, strict=False))
    assert all(t.cpu > 0 for t in engine.timeline)  # each ran a forward on this thread


def test_without_recording_there_is_no_timeline(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    # what an AsyncEngine's step_timeline() filters: a pipeline without record_step_timeline returns []
    engine = new_engine(record_timeline=False)
    add(engine, "r", prompt(hf_tokenizer, "go"), max_tokens=2, temperature=0.0)
    run_all(engine)
    assert engine.timeline == []
