"""CallsCheck: an answer whose grammar spans text and calls, checked whole and then call by call.

The whole-answer grammar (``ToolPlan.spans_answer``) is a structural tag, so its own check is the
grammar engine's acceptor: the same engine that constrained the answer, blind where it is (xgrammar
0.2.8 lets a raw TAB into a string with ``maxLength``). Each call found in the answer is therefore
also parsed strictly and checked against one call's whole JSON schema (rule 7 of the README).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import anyio

from pipeline.answer.call_split import CallSplit
from pipeline.protocol.tool_calls import CallReader
from pipeline.protocol.tools import ToolPlan
from pipeline.types import GrammarSpec
from stages.grammar import CompiledConstraint
from stages.grammar.answer_check import AnswerCheck, Violation, build_answer_check

__all__ = ["CallsCheck", "with_calls_check"]


async def with_calls_check(constraint: CompiledConstraint, plan: ToolPlan | None) -> CompiledConstraint:
    """``constraint`` whose check also holds each call to its schema, where ``plan``'s grammar spans
    the answer (else ``constraint`` itself).

    :raises GrammarError: the call schema cannot be checked (naming ``tools``).
    """
    if plan is None or plan.call_schema is None:
        return constraint
    spec = GrammarSpec("json_schema", plan.call_schema, field="tools")
    call = await anyio.to_thread.run_sync(build_answer_check, spec)  # up to ms for a big schema
    check = CallsCheck(constraint.check, call, plan.format.marker or "", plan.format.arguments_key)
    return dataclasses.replace(constraint, check=check)


@dataclass(frozen=True, slots=True)
class CallsCheck:
    """``whole``: the grammar's check of the answer; ``call``: the strict check of one call object."""

    whole: AnswerCheck
    call: AnswerCheck
    marker: str  # the text that opens the calls; empty: a call is the whole answer
    arguments_key: str

    def check(self, text: str) -> Violation | None:
        """None when the answer passes its grammar and every call in it its schema."""
        violation = self.whole.check(text)
        if violation is not None:
            return violation
        split = CallSplit(self.marker)
        _, calls = split.feed(text, True)
        if not split.is_open:
            return None  # text alone claims nothing
        reader = CallReader(self.arguments_key)
        reader.feed(calls)
        if not reader.calls:
            return Violation("", "the answer opens a tool call but holds none", "tools")
        for i, call in enumerate(reader.calls):
            # the model's own arguments text, so the strict parse sees what the client gets
            found = self.call.check(f'{{"name": {json.dumps(call.name)}, "{self.arguments_key}": {call.arguments}}}')
            if found is not None:
                return Violation(f"/{i}{found.path}", f"tool call {i}: {found.message}", found.reason)
        return None
