"""What a process that does not compile grammars checks of a spec itself: its cheap refusals before any
compile, and the answer check of every finished answer.

With the engine in its own process (``engine_mode="process"``) the grammars are compiled there, where
they are matched; the serving process keeps the answer check (``stages.grammar.answer_check``). A JSON schema's,
a regex's and a choice's check need no compiled grammar. A grammar's or a structural tag's check is a
compiled grammar's own acceptor: it is compiled here by xgrammar against an empty vocabulary, which
skips the token masks that make a compile cost (measured: an EBNF grammar 0.3 ms, a structural tag
holding a JSON schema 2 ms); a Lark grammar xgrammar cannot read is llguidance's (milliseconds).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import xgrammar as xgr

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec
from sampling.guided.llguidance.backend import LLGuidanceBackend
from stages.grammar.answer_check import AnswerCheck, build_answer_check
from stages.grammar.backends import LLGuidanceCompiler, XGrammarCompiler, refuse_without_values
from stages.grammar.dispatch import is_lark
from stages.grammar.limits import GrammarLimits, check_limits
from stages.grammar.schema_support import check_schema_support

__all__ = ["CheckBuilder", "precheck"]

_ACCEPTOR_KINDS = frozenset({"grammar", "structural_tag"})


def precheck(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """The refusals every compile makes before the library sees the spec, in the compilers' order, so
    the 400 names the same field with the same message wherever the compile runs (milliseconds).

    :raises GrammarError: naming ``spec.field``: over a limit, a schema without values, keywords
        refused in strict mode.
    """
    check_limits(spec, limits)
    if spec.kind == "json_schema":
        refuse_without_values(spec)
        if isinstance(spec.value, dict):
            check_schema_support(spec.value, strict=spec.strict, field=spec.field)


class CheckBuilder:
    """Answer checks of specs compiled elsewhere; ``llguidance`` builds the backend a Lark grammar's
    acceptor needs, on first use."""

    def __init__(self, *, any_whitespace: bool, llguidance: Callable[[], LLGuidanceBackend]) -> None:
        self._xgrammar = XGrammarCompiler(xgr.TokenizerInfo([]), any_whitespace=any_whitespace)
        self._make_llguidance = llguidance
        self._llguidance: LLGuidanceCompiler | None = None
        self._lock = threading.Lock()  # checks are built on worker threads

    def build(self, spec: GrammarSpec) -> AnswerCheck:
        """The check of every answer under ``spec`` (synchronous: up to milliseconds).

        :raises GrammarError: naming ``spec.field``: the constraint cannot be checked.
        """
        if spec.kind not in _ACCEPTOR_KINDS and spec.kind != "regex":
            return build_answer_check(spec)
        try:
            acceptor = self._xgrammar.acceptor(spec)
        except GrammarError:
            if spec.kind == "grammar" and is_lark(spec.value):
                return self._llguidance_compiler().compile(spec).check  # Lark only llguidance reads
            if spec.kind != "regex":
                raise
            acceptor = None  # Rust's regex engine checks it, or refuses it
        return build_answer_check(spec, grammar_acceptor=acceptor)

    def _llguidance_compiler(self) -> LLGuidanceCompiler:
        with self._lock:
            if self._llguidance is None:
                self._llguidance = LLGuidanceCompiler(self._make_llguidance())
            return self._llguidance
