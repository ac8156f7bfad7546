"""A grammar compile or parse as it runs in a worker thread: bounded, on a large stack, at a given niceness.

What reaches a compiler is bounded (``stages.grammar_limits``): the size on the loop (the cache key
holds it), the rest here, in the compile thread. Each compile runs on a thread with a large stack
and a large one trims the heap after it (``stages.native_calls``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec
from sampling.llguidance_matcher import INTERNAL_FAILURE
from stages.grammar_backends import Compiled, LLGuidanceCompiler, XGrammarCompiler
from stages.grammar_limits import GrammarLimits, check_limits
from stages.native_calls import release_free_memory, run_on_large_stack

__all__ = ["BACKGROUND_NICE", "compile_in_thread", "parse_in_thread"]

# After a compile this long, or of a spec this large, the heap is trimmed: its peak (a 20,000-rule
# grammar: over 1 GB) would otherwise stay with the process
_TRIM_AFTER_S = 0.5
_TRIM_AFTER_CHARS = 64 * 1024
BACKGROUND_NICE = 19


def compile_in_thread(
    compilers: Mapping[str, XGrammarCompiler | LLGuidanceCompiler],
    backend: str,
    spec: GrammarSpec,
    limits: GrammarLimits,
    nice: int,
) -> Compiled:
    """``backend``'s compile of ``spec`` within ``limits``, ``nice`` added to its thread's niceness; its
    compiler is looked up here, once the job has its slot.

    :raises GrammarError: the spec is refused or cannot be compiled (a Rust panic included).
    """
    check_limits(spec, limits)
    started = time.perf_counter()
    try:
        return run_on_large_stack(lambda: compilers[backend].compile(spec), nice=nice)
    except BaseException as exc:
        # a Rust panic that llguidance's bindings let through is pyo3's PanicException, a
        # BaseException: it fails this spec, not the stage's task group
        if type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(f"could not compile the {spec.kind}: {INTERNAL_FAILURE}", field=spec.field) from None
    finally:
        if time.perf_counter() - started > _TRIM_AFTER_S or len(spec.key) > _TRIM_AFTER_CHARS:
            release_free_memory()


def parse_in_thread(parser: XGrammarCompiler, spec: GrammarSpec, limits: GrammarLimits) -> None:
    """xgrammar's parse of a grammar or structural tag within ``limits``.

    :raises GrammarError: the grammar or tag is malformed or out of bounds.
    """
    check_limits(spec, limits)  # a compile's bounds and stack: the parse reads the same text
    run_on_large_stack(lambda: parser.parse(spec))
