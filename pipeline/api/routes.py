"""The OpenAI-compatible API as plain calls: body bytes in, a ``Reply`` or a ``StreamReply`` out.

Both front ends answer through this module: the aiohttp server (``pipeline.api.server``) and the Ray
Serve replicas (``pipeline.scaleout.ray_serve``). Request parsing, error shapes, status codes and the
server-sent event format are written here once; a front end only moves bytes. Errors become HTTP
here and only here (``error_reply``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST

from pipeline.answer.choice import Result
from pipeline.answer.handle import RequestHandle
from pipeline.api.completions import answer_completions
from pipeline.api.openapi import openapi_json
from pipeline.api.replies import DONE, Reply, Send, StreamReply, built_reply, error_reply, event, json_reply
from pipeline.api.responses import ChatStream, TokenText, chat_choice
from pipeline.core.pipeline import Pipeline
from pipeline.core.tokenizing import detokenize, token_strings, tokenize
from pipeline.errors import PipelineError
from pipeline.protocol.request import ChatRequest
from pipeline.protocol.response_bodies import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    Model,
    ModelList,
    Usage,
)
from pipeline.protocol.tokenize import DetokenizeResponse, TokenizeResponse, parse_detokenize, parse_tokenize

__all__ = ["Api", "Call", "usage"]

# Bodies above this are decoded in a worker thread: msgspec decodes and validates 1 MB of base64
# image body in 0.28 ms, so below it the loop stalls well under a millisecond (rule 1).
INLINE_BODY_BYTES = 1024 * 1024


def usage(result: Result) -> Usage:
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    )


Call = Callable[[bytes], Awaitable[Reply | StreamReply]]


class Api:
    """The routes of the OpenAI-compatible API over one started ``Pipeline``."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self._json_limiter = anyio.CapacityLimiter(1)  # decoding holds the GIL: one at a time
        self._tokens: TokenText | None = None
        self._routes: dict[tuple[str, str], Call] = {
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/v1/models"): self._sync(self.models),
            ("GET", "/health"): self._sync(self.health),
            ("GET", "/metrics"): self._sync(self.metrics),
            ("GET", "/openapi.json"): self._sync(self.openapi),
        }

    @property
    def tokens(self) -> TokenText:
        """Each token's bytes, for log-probability entries."""
        if self._tokens is None:
            self._tokens = TokenText(self.pipe.token_table)
        return self._tokens

    def route(self, method: str, path: str) -> Call | None:
        """The call that answers ``method path`` (its body as the one argument); None: no such route."""
        return self._routes.get((method.upper(), path))

    @staticmethod
    def _sync(call: Callable[[], Reply]) -> Callable[[bytes], Awaitable[Reply]]:
        async def answer(body: bytes) -> Reply:
            return call()

        return answer

    async def _decode(self, parse: Callable[[bytes], Any], body: bytes) -> Any:
        if len(body) < INLINE_BODY_BYTES:
            return parse(body)
        # A burst of image requests carries megabytes of base64 each: decoded on the loop, 128 of them
        # would queue the /health probe behind them (rule 1).
        return await anyio.to_thread.run_sync(parse, body, limiter=self._json_limiter)

    async def _admit(self, body: bytes) -> RequestHandle:
        """Parse ``body`` and submit it, on the loop in one of the pipeline's turns (see
        ``LoopTurns``); a large body is parsed in a thread first, outside any turn."""
        if len(body) >= INLINE_BODY_BYTES:
            request: ChatRequest = await self._decode(self.pipe.parse, body)
            async with self.pipe.loop_turns:
                return await self.pipe.submit(request)
        async with self.pipe.loop_turns:
            return await self.pipe.submit(self.pipe.parse(body))

    # -- POST ---------------------------------------------------------------------------------
    async def chat_completions(self, body: bytes) -> Reply | StreamReply:
        try:
            handle = await self._admit(body)
        except PipelineError as exc:
            return error_reply(exc)
        model = handle.request.model or self.pipe.model_name
        created = int(time.time())
        if handle.request.stream:
            return StreamReply(partial(self._chat_stream, handle, model, created))
        try:
            result = await handle.result()  # a cancelled caller cancels the request here
        except PipelineError as exc:
            return error_reply(exc)
        wants_logprobs = handle.request.sampling.logprobs is not None

        def reply() -> Reply:
            return json_reply(
                ChatCompletion(
                    id=f"chatcmpl-{handle.request_id}",
                    created=created,
                    model=model,
                    choices=[
                        chat_choice(c, wants_logprobs, self.tokens, _arguments_key(handle)) for c in result.choices
                    ],
                    usage=usage(result),
                    timings=result.timings,
                )
            )

        return await built_reply(reply, per_token=wants_logprobs, turns=self.pipe.loop_turns)

    async def _chat_stream(self, handle: RequestHandle, model: str, created: int, send: Send) -> None:
        chunk_id = f"chatcmpl-{handle.request_id}"
        chunks = ChatStream(handle.request.sampling.logprobs is not None, self.tokens, _arguments_key(handle))
        sent = False

        async def send_chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> None:
            nonlocal sent
            sent = True
            await send(
                event(ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=choices, usage=usage))
            )

        try:
            first = True
            async for delta in handle:
                if first:
                    for i in range(handle.request.sampling.n):
                        await send_chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                    first = False
                choices = chunks.choices(delta)
                if choices:
                    await send_chunk(choices)
            if handle.request.include_usage:
                await send_chunk([], usage(await handle.result()))
            await send(DONE)
        except PipelineError as exc:
            if not sent:
                raise
            await send(event({"error": exc.to_dict()}))  # headers are gone: in-band, as OpenAI does
            await send(DONE)
        except BaseException:
            handle.cancel()  # the client went away mid-stream, or the caller was cancelled
            raise

    async def completions(self, body: bytes) -> Reply | StreamReply:
        try:
            requests = await self._decode(self.pipe.parse_completions, body)
            return await answer_completions(self.pipe, requests, self.tokens)
        except PipelineError as exc:
            return error_reply(exc)

    async def tokenize(self, body: bytes) -> Reply:
        pipe = self.pipe
        try:
            job = await self._decode(
                lambda raw: parse_tokenize(raw, model_names=pipe.model_names, parse_chat=pipe.parse), body
            )
            ids = await tokenize(pipe.preparation.template, job)
        except PipelineError as exc:
            return error_reply(exc)
        strs = token_strings(pipe.preparation.template, ids) if job.return_token_strs else None
        return json_reply(
            TokenizeResponse(count=len(ids), max_model_len=pipe.config.max_model_len, tokens=ids, token_strs=strs)
        )

    async def detokenize(self, body: bytes) -> Reply:
        pipe = self.pipe
        try:
            ids = await self._decode(
                lambda raw: parse_detokenize(raw, model_names=pipe.model_names, vocab_size=pipe.vocab_size), body
            )
        except PipelineError as exc:
            return error_reply(exc)
        return json_reply(DetokenizeResponse(prompt=await detokenize(pipe.preparation.template, ids)))

    # -- GET ----------------------------------------------------------------------------------
    def models(self) -> Reply:
        return json_reply(ModelList(data=[Model(id=name) for name in self.pipe.model_names]))

    def health(self) -> Reply:
        status = self.pipe.health()
        return json_reply(status, 200 if status["status"] == "ok" else 503)

    def metrics(self) -> Reply:
        return Reply(200, self.pipe.render_metrics(), {"Content-Type": CONTENT_TYPE_LATEST})

    def openapi(self) -> Reply:
        return Reply(200, openapi_json())


def _arguments_key(handle: RequestHandle) -> str:
    """The key of a call's arguments in the model's call format (Llama 3 writes ``parameters``)."""
    plan = handle.request.tools
    return plan.format.arguments_key if plan is not None else "arguments"
