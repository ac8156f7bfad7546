"""A grammar compile or parse as it runs on a compile thread: bounded, on a large stack, at a given niceness.

What reaches a compiler is bounded (``stages.grammar.limits``): the size on the loop (the cache key
holds it), the rest here, on the compile thread. Each compile runs on one of the process's long-lived
threads with a large stack, and a large one trims the heap after it (``stages.grammar.native_calls``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import anyio

from pipeline.errors import GrammarError
from pipeline.types import GrammarSpec
from sampling.guided.llguidance.matcher import INTERNAL_FAILURE
from stages.grammar.backends import Compiled, LLGuidanceCompiler, XGrammarCompiler
from stages.grammar.limits import GrammarLimits, check_limits
from stages.grammar.native_calls import release_free_memory, run_on_large_stack

__all__ = ["BACKGROUND_NICE", "compile_on_thread", "parse_on_thread"]

# After a compile this long, or of a spec this large, the heap is trimmed: its peak (a 20,000-rule
# grammar: over 1 GB) would otherwise stay with the process
_TRIM_AFTER_S = 0.5
_TRIM_AFTER_CHARS = 64 * 1024
BACKGROUND_NICE = 19


async def compile_on_thread(
    compilers: Mapping[str, XGrammarCompiler | LLGuidanceCompiler],
    backend: str,
    spec: GrammarSpec,
    limits: GrammarLimits,
    *,
    nice: int,
    limiter: anyio.CapacityLimiter,
    abandon_on_cancel: bool,
) -> Compiled:
    """``backend``'s compile of ``spec`` within ``limits``, on a compile thread at ``nice`` under a
    token of ``limiter`` (``abandon_on_cancel``: as ``anyio.to_thread.run_sync``'s).

    :raises GrammarError: the spec is refused or cannot be compiled (a Rust panic included).
    """
    call = functools.partial(_compile, compilers, backend, spec, limits)
    return await run_on_large_stack(call, limiter=limiter, nice=nice, abandon_on_cancel=abandon_on_cancel)


def _compile(
    compilers: Mapping[str, XGrammarCompiler | LLGuidanceCompiler],
    backend: str,
    spec: GrammarSpec,
    limits: GrammarLimits,
) -> Compiled:
    """On the compile thread: the limits the loop left to it, then the compile (its compiler looked up
    here, once the job has its slot), and the heap trimmed after a large one."""
    check_limits(spec, limits)
    started = time.perf_counter()
    try:
        return compilers[backend].compile(spec)
    except BaseException as exc:
        # a Rust panic that llguidance's bindings let through is pyo3's PanicException, a
        # BaseException: it fails this spec, not the stage's task group
        if type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(f"could not compile the {spec.kind}: {INTERNAL_FAILURE}", field=spec.field) from None
    finally:
        if time.perf_counter() - started > _TRIM_AFTER_S or len(spec.key) > _TRIM_AFTER_CHARS:
            release_free_memory()


async def parse_on_thread(
    parser: XGrammarCompiler, spec: GrammarSpec, limits: GrammarLimits, *, limiter: anyio.CapacityLimiter
) -> None:
    """xgrammar's parse of a grammar or structural tag within ``limits``, on a compile thread under a
    token of ``limiter``.

    :raises GrammarError: the grammar or tag is malformed or out of bounds.
    """
    await run_on_large_stack(functools.partial(_parse, parser, spec, limits), limiter=limiter)


def _parse(parser: XGrammarCompiler, spec: GrammarSpec, limits: GrammarLimits) -> None:
    check_limits(spec, limits)  # a compile's bounds and stack: the parse reads the same text
    parser.parse(spec)
