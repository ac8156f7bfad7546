"""What a step hands the fill thread beside its forward: matchers to build and bitmask rows to fill,
or nothing (every guided row greedy with its mask deferred to the sampler, every matcher built)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from pipeline.types import GrammarSpec
from sampling.guided.decoder import GuidedDecoder
from sampling.guided.step_grammar import StepGrammar
from sampling.params import SamplingParams
from sampling.sequence import Sequence
from sampling.timeline import StepTiming
from vision.checkpoint import Checkpoint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _seq(seq_id: int, grammar: Any, temperature: float) -> Sequence:
    # the fill reads the sampling parameters, the grammar, where it starts and what was written under it
    none: Any = None
    params = SamplingParams(max_tokens=8, temperature=temperature)
    return Sequence(seq_id, f"r{seq_id}", 0, [1, 2, 3], None, params, grammar, none, None, none)


def _filled(step_grammar: StepGrammar, seqs: list[Sequence], defer_greedy: bool) -> list[int] | None:
    """The rows the fill thread filled, or None when the step handed it nothing."""
    forward_done: Future[None] = Future()
    forward_done.set_result(None)
    fill = step_grammar.start_fill(seqs, defer_greedy, StepTiming("decode", len(seqs)), forward_done)
    if fill is None:
        return None
    sampled, rows = fill.result(timeout=60)
    assert sampled == seqs
    return rows


def test_a_step_with_nothing_to_fill_hands_the_fill_thread_nothing(
    checkpoint: Checkpoint, grammar_compilers: tuple[Any, Any]
) -> None:
    for compiler in grammar_compilers:  # xgrammar, llguidance
        grammar = compiler.compile(GrammarSpec("json_schema", SCHEMA)).grammar
        step_grammar = StepGrammar(GuidedDecoder(checkpoint.text_config.vocab_size, 4, torch.device("cpu")))
        greedy, sampled, plain = _seq(0, grammar, 0.0), _seq(1, grammar, 1.0), _seq(2, None, 0.0)
        # the first step builds the greedy row's matcher beside the forward; its mask is the sampler's
        assert _filled(step_grammar, [greedy, plain], defer_greedy=True) == []
        assert greedy.matcher is not None
        # then nothing is left to do beside the forward: no hand-off
        assert _filled(step_grammar, [greedy, plain], defer_greedy=True) is None
        assert _filled(step_grammar, [plain], defer_greedy=True) is None
        # a row whose mask is not deferred is filled there (a prefill's last chunk, a GPU's step)
        assert _filled(step_grammar, [greedy, plain], defer_greedy=False) == [0]
        # a sampled row's mask is never deferred: its matcher is built and its row filled there
        assert _filled(step_grammar, [greedy, sampled], defer_greedy=True) == [1]
        assert _filled(step_grammar, [greedy, sampled], defer_greedy=True) == [1]
