"""Chat-completion choices in OpenAI's shape: text or tool calls, finish reasons, log probabilities.

``chat_choice`` renders a finished choice; ``ChatStream`` turns a choice's deltas into stream chunk
choices, a call's id and name first and then its arguments in fragments, as OpenAI streams them.
Both read tool calls with the same ``CallReader``, so a streamed and a whole answer agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.answer.choice import Choice as AnswerChoice
from pipeline.answer.choice import Delta as AnswerDelta
from pipeline.protocol.request_bodies import FunctionCall, ToolCall
from pipeline.protocol.response_bodies import (
    AssistantMessage,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionCallDelta,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
)
from pipeline.protocol.tool_calls import CallReader, CallStart
from pipeline.protocol.tools import new_call_id
from sampling.logits_process import TokenLogprob as SampledLogprob

__all__ = ["ChatStream", "TokenText", "chat_choice", "finish_reason", "token_logprobs"]


class TokenText:
    """A token's text and bytes for log-probability entries (``table``: each id's bytes)."""

    def __init__(self, table: Sequence[bytes]) -> None:
        self.table = table

    def bytes(self, token: int) -> bytes:
        return self.table[token] if 0 <= token < len(self.table) else b""

    def text(self, token: int) -> str:
        # a token may hold part of a character: its bytes say exactly what it is
        return self.bytes(token).decode("utf-8", errors="replace")


def token_logprobs(entries: Sequence[SampledLogprob], tokens: TokenText) -> list[TokenLogprob]:
    """OpenAI's per-token log-probability objects."""

    def top(token: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=tokens.text(token), logprob=logprob, bytes=list(tokens.bytes(token)))

    return [
        TokenLogprob(
            token=tokens.text(e.token_id),
            logprob=e.logprob,
            bytes=list(tokens.bytes(e.token_id)),
            top_logprobs=[top(t, v) for t, v in e.top],
        )
        for e in entries
    ]


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A choice that ended its calls normally finished with ``tool_calls``, as OpenAI says it."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_choice(
    choice: AnswerChoice, wants_logprobs: bool, tokens: TokenText, arguments_key: str = "arguments"
) -> Choice:
    """A finished choice as OpenAI's chat-completion choice (``arguments_key``: the key the model's
    call format gives a call's arguments)."""
    calls: list[ToolCall] | None = None
    if choice.call_text is not None:
        reader = CallReader(arguments_key)
        reader.feed(choice.call_text)
        calls = [
            ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reader.calls
        ]
    logprobs = ChoiceLogprobs(content=token_logprobs(choice.logprobs, tokens)) if wants_logprobs else None
    content = choice.text if choice.text or not (calls or choice.reasoning) else None
    reasoning = choice.reasoning or None
    return Choice(
        index=choice.index,
        message=AssistantMessage(
            content=content, tool_calls=calls or None, reasoning_content=reasoning, reasoning=reasoning
        ),
        finish_reason=finish_reason(choice.finish_reason, bool(calls)),
        logprobs=logprobs,
    )


class ChatStream:
    """The stream chunk choices of one request's deltas (one call reader per choice)."""

    def __init__(self, wants_logprobs: bool, tokens: TokenText, arguments_key: str = "arguments") -> None:
        self.wants_logprobs = wants_logprobs
        self.tokens = tokens
        self.arguments_key = arguments_key
        self._readers: dict[int, CallReader] = {}

    def choices(self, delta: AnswerDelta) -> list[ChunkChoice]:
        """The chunk choices ``delta`` gives: its text or its call pieces, its log probabilities, and
        its finish reason on the last."""
        logprobs = None
        if self.wants_logprobs and delta.logprobs:
            logprobs = ChoiceLogprobs(content=token_logprobs(delta.logprobs, self.tokens))
        if delta.is_reasoning:
            if not delta.text and delta.finish_reason is None and logprobs is None:
                return []  # the end tag alone: it writes neither part
            thought = Delta(reasoning_content=delta.text, reasoning=delta.text) if delta.text else Delta()
            return [ChunkChoice(index=delta.index, delta=thought, finish_reason=delta.finish_reason, logprobs=logprobs)]
        reader = self._readers.get(delta.index)
        if delta.is_call and reader is None:
            reader = self._readers[delta.index] = CallReader(self.arguments_key)
        reason = finish_reason(delta.finish_reason, reader is not None and bool(reader.calls))
        if reader is None or not delta.is_call:
            return [
                ChunkChoice(index=delta.index, delta=Delta(content=delta.text), finish_reason=reason, logprobs=logprobs)
            ]
        pieces = []
        for event in reader.feed(delta.text):
            if isinstance(event, CallStart):
                function = FunctionCallDelta(name=event.name, arguments="")
                pieces.append(ToolCallDelta(index=event.index, id=new_call_id(), type="function", function=function))
            else:
                pieces.append(ToolCallDelta(index=event[0], function=FunctionCallDelta(arguments=event[1])))
        reason = finish_reason(delta.finish_reason, bool(reader.calls))
        if not pieces and reason is None and logprobs is None:
            return []  # a token that completed nothing yet (inside a call's head)
        return [
            ChunkChoice(
                index=delta.index, delta=Delta(tool_calls=pieces or None), finish_reason=reason, logprobs=logprobs
            )
        ]
