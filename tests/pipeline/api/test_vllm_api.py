"""vLLM's request fields and its /tokenize and /detokenize routes, through the server.

One server on the embedded default model for the module; references are the tokenizer's own
``apply_chat_template``, ``encode`` and ``decode`` (transformers), never our own earlier output.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from tests.servers import serving

KEY = "sk-test-tokenize"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[tuple[Pipeline, str]]:
    config = PipelineConfig(
        max_running_seqs=4,
        num_kv_blocks=128,
        max_model_len=1024,
        served_model_names=("m",),
        preparation_mode="thread",
        engine_mode="thread",
        trust_request_chat_template=True,
    )
    async with Pipeline(config) as pipe, serving(create_app(pipe, api_key=KEY)) as base:
        yield pipe, base


async def post(base: str, path: str, body: dict[str, Any], key: str | None = KEY) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.post(f"{base}{path}", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_a_conversation_tokenizes_as_the_chat_template_renders_it(server: tuple[Pipeline, str]) -> None:
    pipe, base = server
    tokenizer = pipe.checkpoint.tokenizer
    status, body = await post(base, "/tokenize", {"model": "m", "messages": MESSAGES, "return_token_strs": True})
    assert status == 200, body
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert body["tokens"] == list(expected)
    assert body["count"] == len(expected) and body["max_model_len"] == 1024
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(list(expected))
    # the count a chat request is billed for
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0) as client:
        answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert answer.usage is not None and answer.usage.prompt_tokens == body["count"]


async def test_a_prompt_tokenizes_as_completions_prefill_it(server: tuple[Pipeline, str]) -> None:
    pipe, base = server
    tokenizer = pipe.checkpoint.tokenizer
    status, body = await post(base, "/tokenize", {"prompt": "Hello there"})
    assert status == 200 and body["token_strs"] is None
    plain = tokenizer.encode("Hello there", add_special_tokens=False)
    assert body["tokens"] == [tokenizer.bos_token_id, *plain]
    status, body = await post(base, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})
    assert body["tokens"] == plain


async def test_detokenize_is_the_tokenizers_decode(server: tuple[Pipeline, str]) -> None:
    pipe, base = server
    tokenizer = pipe.checkpoint.tokenizer
    ids = tokenizer.encode("A round trip, with ünïcode.", add_special_tokens=True)
    status, body = await post(base, "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": tokenizer.decode(ids)}
    status, body = await post(base, "/detokenize", {"tokens": [1, len(tokenizer)]})
    assert status == 400 and body["error"]["param"] == "tokens[1]"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": MESSAGES}, "messages"),
        ({"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/a.png"}]}]}, None),
        ({"prompt": "a", "model": "other"}, "model"),
    ],
    ids=["nothing", "both", "chat-field-on-prompt", "image", "unknown-model"],
)
async def test_tokenize_refusals_name_their_field(
    server: tuple[Pipeline, str], body: dict[str, Any], param: str | None
) -> None:
    status, answer = await post(server[1], "/tokenize", body)
    assert status in (400, 404)
    assert answer["error"]["param"] == (param or "messages[0].content[0].image_url.url")


async def test_tokenize_and_detokenize_need_the_api_key(server: tuple[Pipeline, str]) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        status, answer = await post(server[1], path, body, key=None)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"


async def test_a_requests_chat_template_and_its_kwargs_reach_the_template(server: tuple[Pipeline, str]) -> None:
    pipe, base = server
    template = (
        "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    body = {"messages": MESSAGES, "chat_template": template, "chat_template_kwargs": {"greeting": "Hi"}}
    status, answer = await post(base, "/tokenize", body)
    assert status == 200, answer
    text = "Hi|Name a colour.>"
    assert answer["tokens"] == pipe.checkpoint.tokenizer.encode(text, add_special_tokens=False)
    status, answer = await post(base, "/tokenize", {**body, "add_generation_prompt": False})
    assert answer["tokens"] == pipe.checkpoint.tokenizer.encode(text[:-1], add_special_tokens=False)
    status, answer = await post(base, "/tokenize", {**body, "chat_template_kwargs": {"messages": []}})
    assert status == 400 and answer["error"]["param"] == "chat_template_kwargs.messages"


async def test_continue_final_message_leaves_the_assistants_turn_open(server: tuple[Pipeline, str]) -> None:
    pipe, base = server
    opened = [*MESSAGES, {"role": "assistant", "content": "My favourite is"}]
    status, answer = await post(base, "/tokenize", {"messages": opened, "continue_final_message": True})
    assert status == 200, answer
    expected = pipe.checkpoint.tokenizer.apply_chat_template(opened, continue_final_message=True, return_dict=False)
    assert answer["tokens"] == list(expected)


async def test_truncate_prompt_tokens_keeps_the_prompts_end(server: tuple[Pipeline, str]) -> None:
    pipe, base = server
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0) as client:
        whole = await client.completions.create(model="m", prompt="one two three four five six", max_tokens=1)
        cut = await client.completions.create(
            model="m", prompt="one two three four five six", max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
        )
    assert whole.usage is not None and whole.usage.prompt_tokens > 3
    assert cut.usage is not None and cut.usage.prompt_tokens == 3


async def test_the_new_routes_are_in_the_openapi_document(server: tuple[Pipeline, str]) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{server[1]}/openapi.json") as resp:
        document = await resp.json()
    assert {"/tokenize", "/detokenize"} <= set(document["paths"])
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"chat_template_kwargs", "repetition_penalty", "min_p", "bad_words", "truncate_prompt_tokens"} <= set(chat)
