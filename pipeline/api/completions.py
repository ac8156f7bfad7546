"""``POST /v1/completions``: raw prompts, one pipeline request each, answered as one completion.

Every prompt is admitted as a request of its own (so the admission bound counts each); if one is
refused, those admitted before it are cancelled and the refusal is the answer. Streamed, the deltas
of all prompts interleave as they come, each chunk naming its choice ``i * n + j``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import anyio
import msgspec

from pipeline.answer.choice import Choice as AnswerChoice
from pipeline.answer.choice import Delta as AnswerDelta
from pipeline.answer.choice import Result
from pipeline.answer.handle import RequestHandle
from pipeline.api.replies import DONE, Reply, Send, StreamReply, built_reply, event
from pipeline.api.responses import TokenText
from pipeline.core.pipeline import Pipeline
from pipeline.errors import PipelineError
from pipeline.protocol.request import ChatRequest
from pipeline.protocol.response_bodies import Completion, CompletionChoice, CompletionLogprobs, Usage
from sampling.logits_process import TokenLogprob

__all__ = ["answer_completions"]


def _logprobs(entries: Sequence[TokenLogprob], tokens: TokenText, offset: int) -> CompletionLogprobs:
    """The legacy parallel lists; ``offset``: where the first token's text starts in the choice."""
    texts = [tokens.text(e.token_id) for e in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{tokens.text(t): v for t, v in e.top} for e in entries],
        text_offset=offsets,
    )


def _usage(results: Sequence[Result]) -> Usage:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _submit_all(pipe: Pipeline, requests: list[ChatRequest]) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles.append(await pipe.submit(request))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


class _Stream:
    """Writes one completion stream; chunks of every prompt, in the order they come."""

    def __init__(self, send: Send, base: Completion, tokens: TokenText, n: int) -> None:
        self._send, self.base, self.tokens, self.n = send, base, tokens, n
        self.sent = False  # an error before the first event is still a plain 4xx
        self.offsets: dict[int, int] = {}
        self.lock = anyio.Lock()

    async def write(self, payload: object) -> None:
        async with self.lock:  # one writer at a time: prompts stream from tasks of their own
            self.sent = True
            await self._send(event(payload))

    async def write_done(self) -> None:
        async with self.lock:
            self.sent = True
            await self._send(DONE)

    async def send(self, prompt: int, delta: AnswerDelta, wants_logprobs: bool) -> None:
        index = prompt * self.n + delta.index
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(delta.text)
        logprobs = _logprobs(delta.logprobs or [], self.tokens, offset) if wants_logprobs else None
        choice = CompletionChoice(index=index, text=delta.text, finish_reason=delta.finish_reason, logprobs=logprobs)
        await self.write(msgspec.structs.replace(self.base, choices=[choice]))

    async def pump(self, prompt: int, handle: RequestHandle) -> None:
        async for delta in handle:
            await self.send(prompt, delta, handle.request.sampling.logprobs is not None)


async def _write_stream(
    handles: list[RequestHandle], base: Completion, tokens: TokenText, include_usage: bool, send: Send
) -> None:
    """``StreamReply.write`` of a completion: every prompt's deltas as they come, then ``[DONE]``."""
    stream = _Stream(send, base, tokens, handles[0].request.sampling.n)
    error: PipelineError | None = None
    gone = False
    try:
        try:
            async with anyio.create_task_group() as tg:
                for i, handle in enumerate(handles):
                    tg.start_soon(stream.pump, i, handle)
            if include_usage:
                results = [await handle.result() for handle in handles]
                await stream.write(msgspec.structs.replace(base, usage=_usage(results)))
        except* PipelineError as group:
            error = group.exceptions[0]  # type: ignore[assignment]  # the first prompt to fail ends them all
        except* ConnectionError:
            gone = True
    except BaseException:
        for handle in handles:  # the caller was cancelled
            handle.cancel()
        raise
    if gone:
        for handle in handles:
            handle.cancel()
        raise ConnectionResetError("the client went away mid-stream")
    if error is not None:
        for handle in handles:
            handle.cancel()
        if not stream.sent:
            raise error
        await stream.write({"error": error.to_dict()})  # headers are gone: in-band, as OpenAI does
    await stream.write_done()


async def answer_completions(pipe: Pipeline, requests: list[ChatRequest], tokens: TokenText) -> Reply | StreamReply:
    """Submit every prompt and answer them as one completion (streamed or whole).

    :raises PipelineError: a refusal at admission, or the first error of a prompt (unstreamed).
    """
    handles = await _submit_all(pipe, requests)
    first = requests[0]
    n = first.sampling.n
    model = first.model or pipe.model_name
    base = Completion(id=first.request_id.rsplit("-", 1)[0], created=int(time.time()), model=model, choices=[])
    if first.stream:
        return StreamReply(partial(_write_stream, handles, base, tokens, first.include_usage))
    wants_logprobs = first.sampling.logprobs is not None
    try:
        results = [await handle.result() for handle in handles]
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise

    def choice(prompt: int, c: AnswerChoice) -> CompletionChoice:
        logprobs = _logprobs(c.logprobs, tokens, 0) if wants_logprobs else None
        return CompletionChoice(
            index=prompt * n + c.index, text=c.text, finish_reason=c.finish_reason, logprobs=logprobs
        )

    def reply() -> Reply:
        choices = [choice(i, c) for i, r in enumerate(results) for c in r.choices]
        return Reply(200, msgspec.json.encode(msgspec.structs.replace(base, choices=choices, usage=_usage(results))))

    return await built_reply(reply, per_token=wants_logprobs, turns=pipe.loop_turns)
