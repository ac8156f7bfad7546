"""The grammar stage's values: a request's compiled constraint, the reasons that make one a stand-in, the
counts; and what both grammar stages (``stages.grammar``, ``pipeline.engine.remote_grammar``) make of them."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import PipelineError
from stages.grammar.answer_check import AnswerCheck
from stages.grammar.cache import GrammarCache

__all__ = [
    "FIRST_USE",
    "OUTLASTS",
    "SLOTS_BUSY",
    "STAND_IN_REASONS",
    "CompiledConstraint",
    "GrammarStats",
    "cache_counters",
    "cached_entry",
    "counted_hit",
    "unwrap",
]

# why llguidance served a spec meant for xgrammar: its grammar is replaced once xgrammar compiled it
SLOTS_BUSY = "xgrammar compile slots busy"
OUTLASTS = "xgrammar compile outlasts preparation"  # (the name metrics have known it by)
FIRST_USE = "first use of the spec"  # xgrammar compiles at the spec's second use
STAND_IN_REASONS = frozenset({SLOTS_BUSY, OUTLASTS, FIRST_USE})


@dataclass
class GrammarStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0
    compile_seconds: float = 0.0
    backends: Counter[str] = field(default_factory=Counter)  # compiles by "backend: reason"


@dataclass(frozen=True, slots=True, eq=False)
class CompiledConstraint:
    """A request's compiled constraint: what the engine makes matchers from, and the check every
    finished answer must pass."""

    kind: str
    backend: str  # "xgrammar" | "llguidance"
    reason: str  # why that backend (a dispatch row, "default", "xgrammar busy", ...)
    grammar: Any  # xgr.CompiledGrammar | LLGrammar
    check: AnswerCheck
    nbytes: int
    is_stand_in: bool = False  # llguidance's, until xgrammar's compile of the same spec replaces it


def unwrap(result: CompiledConstraint | PipelineError, stage: str, request_id: str | None) -> CompiledConstraint:
    """``result``, a compiled or cached verdict, for one request.

    :raises PipelineError: a copy of the refusal ``result``, carrying ``stage`` and ``request_id``.
    """
    if isinstance(result, PipelineError):
        error = copy.copy(result)  # one error object per request: each carries its own request id
        error.stage, error.request_id = stage, request_id
        raise error
    return result


def cached_entry(cache: GrammarCache[CompiledConstraint], key: str) -> CompiledConstraint | PipelineError | None:
    """The entry of ``key`` (a constraint, or a refusal), without touching its recency."""
    entry = cache.get(key)
    assert entry is None or isinstance(entry, CompiledConstraint | PipelineError)
    return entry


def counted_hit(
    stats: GrammarStats, cache: GrammarCache[CompiledConstraint], key: str
) -> CompiledConstraint | PipelineError | None:
    """The entry of ``key``, now the most recently used, counted in ``stats`` as a hit (or a miss: None)."""
    entry = cache.hit(key)
    if entry is None:
        stats.misses += 1
        return None
    stats.hits += 1
    assert isinstance(entry, CompiledConstraint | PipelineError)
    return entry


def cache_counters(stats: GrammarStats, cache: GrammarCache[CompiledConstraint]) -> dict[str, float]:
    """A grammar stage's cache: hits, misses, evictions, bytes and entries (for metrics)."""
    return {
        "hits": stats.hits,
        "misses": stats.misses,
        "evictions": cache.evictions,
        "bytes": cache.num_bytes,
        "bytes_bound": cache.max_bytes,
        "entries": len(cache),
    }
