"""Whether a compiled grammar of either backend accepts a whole text (then the stop token); a gate on
a real compiler."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import xgrammar as xgr

from pipeline.types import GrammarSpec
from sampling.guided.llguidance.matcher import LLGrammar, new_matcher
from stages.grammar.backends import Compiled

EOS = 2  # </s> of the embedded tokenizer


def accepts(grammar: Any, text: str, hf_tokenizer: Any = None) -> bool:
    """``text`` is a complete sentence of ``grammar`` (xgrammar: by bytes; llguidance: by the
    tokenizer's tokens, so it needs ``hf_tokenizer``)."""
    if isinstance(grammar, LLGrammar):
        matcher = new_matcher(grammar)
        tokens = hf_tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(EOS)
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.accept_token(EOS) and matcher.is_terminated()


class GatedCompiler:
    """A real compiler whose compiles wait for ``gate`` and are counted (the stage takes its
    compilers as arguments: this is the seam the tests use)."""

    def __init__(self, real: Any, gate: threading.Event | None = None) -> None:
        self.real, self.gate = real, gate
        self.name = real.name
        self.calls: Counter[str] = Counter()
        self.nice: dict[str, int] = {}  # the compile thread's niceness, by spec

    def parse(self, spec: GrammarSpec) -> None:
        self.real.parse(spec)

    def compile(self, spec: GrammarSpec) -> Compiled:
        self.calls[spec.key] += 1
        self.nice[spec.key] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if self.gate is not None:
            self.gate.wait(20)
        return self.real.compile(spec)
