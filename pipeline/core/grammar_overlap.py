"""When a request goes to the engine before its grammar compile ends, and what the engine then waits on.

A text-only or cached-image request's preparation ends in about a millisecond and hides nothing of a
new schema's compile: such a request goes to the engine at once and its prefill runs beside the
compile. Its first token is sampled after that forward when the compile has ended by then (a
millisecond at most past it: llguidance's compile of a schema takes about as long as the forward);
otherwise its last prompt token runs again, held by the scheduler until the compile ends, so no step
waits for a compile (sampling/step.py). Its handle waits for the compile's verdict before any token
leaves (a refused spec is still the 400 naming its field). An engine in this process waits on a
``Future`` of the grammar (``settle`` fills it); one in its own process on its own compile of the spec.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pipeline.outcome import Outcome
from pipeline.protocol.request import ChatRequest
from stages.grammar.dispatch import LLGUIDANCE_KINDS, PARSED_KINDS
from stages.grammar.types import CompiledConstraint

__all__ = ["overlaps", "settle"]

# Kinds llguidance compiles in milliseconds wherever the backend choice lets it (it stands in for
# xgrammar in auto): the request samples once the compile has ended.
# Grammars and structural tags may wait for xgrammar's compile (seconds): they keep the path where the
# request is sent after its verdict.
_OVERLAP_KINDS = LLGUIDANCE_KINDS - PARSED_KINDS


def overlaps(request: ChatRequest, grammar: Outcome[CompiledConstraint | None], backend: str) -> bool:
    """Whether ``request``, whose preparation is done, goes to the engine before ``grammar`` (its
    compile) ends; never for tools (their grammars wait for xgrammar) or a forced xgrammar ``backend``."""
    spec = request.grammar
    return (
        spec is not None
        and not grammar.is_done
        and request.tools is None
        and spec.kind in _OVERLAP_KINDS
        and backend in ("auto", "llguidance")
    )


def settle(compiled: Future[Any] | None, grammar: Outcome[CompiledConstraint | None]) -> None:
    """Hand the compile's grammar (or its failure: a cancelled compile too) to an engine in this
    process that may wait on ``compiled``."""
    if compiled is None or compiled.done():
        return
    if grammar.is_done and grammar.error is None:
        constraint = grammar.get()
        compiled.set_result(constraint.grammar if constraint is not None else None)
    else:
        compiled.set_exception(grammar.error or RuntimeError("the grammar compile was cancelled"))
