"""``auto`` without a marker token: the grammar over the whole answer, per call format, compiled by
xgrammar and read back by its acceptor (text, or calls in the family's own syntax)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import xgrammar as xgr

from pipeline.protocol.request_bodies import ChatCompletionRequest
from pipeline.protocol.tool_formats import FORMATS
from pipeline.protocol.tools import plan_tools
from pipeline.protocol.wire import decode_body
from stages.grammar.answer_check import xgrammar_acceptor

TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
BODY = {
    "messages": [{"role": "user", "content": "Time?"}],
    "tools": [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}],
}
# a vocabulary of single characters is enough for the acceptor, which reads text
VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\t"]


def _accepts(fmt_name: str, **extra: object) -> Callable[[str], bool]:
    fmt = dataclasses.replace(FORMATS[fmt_name], marker_is_token=False)
    plan = plan_tools(decode_body(json.dumps({**BODY, **extra}).encode(), ChatCompletionRequest), False, fmt)
    assert plan is not None and plan.spans_answer and plan.grammar.kind == "structural_tag"
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB), cache_enabled=False)
    return xgrammar_acceptor(compiler.compile_structural_tag(json.dumps(plan.grammar.value)))


CALL = '{"name": "get_time", "KEY": {"zone": "UTC"}}'


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("mistral", f"Sure [TOOL_CALLS][{CALL}, {CALL}]", f"[TOOL_CALLS]{CALL}"),
        ("hermes", f"Sure <tool_call>{CALL}</tool_call>", f"<tool_call>[{CALL}]</tool_call>"),
        ("llama3_json", CALL.replace("KEY", "parameters"), "{ not a call }"),
    ],
)
def test_the_whole_answer_is_text_or_calls_in_the_family_syntax(fmt: str, good: str, bad: str) -> None:
    key = FORMATS[fmt].arguments_key
    accepts = _accepts(fmt)
    assert accepts(good.replace("KEY", key))
    assert accepts("Just text, no call.")
    assert not accepts(bad.replace("KEY", key))
