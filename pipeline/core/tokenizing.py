"""``/tokenize`` and ``/detokenize``: the template stage's rendering, without a request to decode.

A conversation goes through the same ``TemplateStage.render`` a chat request does (in its worker
thread, under its limiter, in the lane its size calls for), so the ids are the prompt that request
would prefill; a prompt string is encoded as ``/v1/completions`` encodes it.
"""

from __future__ import annotations

from typing import Any

import anyio

from pipeline.errors import PromptTooLong
from pipeline.protocol.tokenize import TokenizeJob
from stages.template import TemplateStage
from stages.tokens import with_bos

__all__ = ["detokenize", "token_strings", "tokenize"]


async def tokenize(template: TemplateStage, job: TokenizeJob) -> list[int]:
    """The token ids of ``job``. :raises InvalidRequest: the template refused the conversation.
    :raises PromptTooLong: the prompt is longer than a prompt may be."""
    tokenizer = template.tokenizer
    if job.chat is not None:
        chat = job.chat
        tools = chat.tools.tools if chat.tools is not None else ()
        large = template.is_large(chat.render_chars)
        ids = await template.run(chat.messages, [], tools, None, "messages", chat.template, large=large)
        return with_bos(tokenizer, ids) if job.add_special_tokens else ids
    assert job.prompt is not None
    large = template.is_large(len(job.prompt))
    if job.add_special_tokens:  # exactly what /v1/completions prefills for this prompt
        return await template.run((), [], (), job.prompt, "prompt", large=large)
    bound = template.max_text_chars
    if bound is not None and len(job.prompt) > bound:  # as render() refuses it, before any encoding
        raise PromptTooLong(
            f"the prompt is {len(job.prompt)} characters, more than {template.max_prompt_tokens} tokens can hold",
            field="prompt",
        )
    lane = template.large_offload if large else template.offload
    return await lane.run(_encode_plain, tokenizer, job.prompt)


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_strings(template: TemplateStage, ids: list[int]) -> list[str]:
    """Each id's vocabulary entry (a byte-level vocabulary writes a leading space as ``Ġ``), as vLLM returns them."""
    return [str(token) for token in template.tokenizer.convert_ids_to_tokens(ids)]


async def detokenize(template: TemplateStage, ids: list[int]) -> str:
    """The text of ``ids``, special tokens included (vLLM's /detokenize keeps them)."""
    return await anyio.to_thread.run_sync(template.tokenizer.decode, ids, limiter=template.limiter)
