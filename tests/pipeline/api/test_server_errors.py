"""Every error in OpenAI's shape and every limit a 4xx: the cases found by hand, over HTTP."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import PipelineConfig
from pipeline.api.openapi import openapi_document
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from stages.grammar.types import FIRST_USE
from tests.images import data_url, encode, make_image
from tests.released import assert_released
from tests.servers import serving

BODY_LIMIT = 1024 * 1024


@dataclass
class Server:
    pipe: Pipeline
    base: str
    session: aiohttp.ClientSession
    client: openai.AsyncOpenAI

    async def post(self, body: bytes | dict[str, Any], path: str = "/v1/chat/completions") -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        data = io.BytesIO(raw) if len(raw) > 1_000_000 else raw  # aiohttp warns on large bytes bodies
        async with self.session.post(f"{self.base}{path}", data=data, headers=headers) as resp:
            return resp.status, await resp.json()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[Server]:
    # 128 blocks of 16: the cache holds 2,048 tokens; a prompt over 1,024 tokens is over max_model_len
    config = PipelineConfig(
        max_running_seqs=4,
        num_kv_blocks=128,
        max_model_len=1024,
        served_model_names=("m", "alias"),
        engine_mode="thread",
    )
    async with (
        Pipeline(config) as pipe,
        serving(create_app(pipe, max_body_bytes=BODY_LIMIT), handler_cancellation=True) as base,
        aiohttp.ClientSession() as session,
    ):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        try:
            yield Server(pipe, base, session, client)
        finally:
            await client.close()
            await assert_released(pipe)


def user(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2}


def assert_openai_error(status: int, body: Any, expected: int, param: str | None, code: str) -> None:
    assert status == expected, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert isinstance(error["message"], str) and error["message"]


def image_part(width: int, height: int) -> dict[str, Any]:
    url = data_url(encode(make_image(width, height, seed=3)))
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"[" * 200_000 + b"]" * 200_000, "body"),
        (b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "messages[0]"),
        (b'{"messages": ' + b"[" * 1_000 + b"]" * 1_000 + b"}", "messages[0]"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "guided_json": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            "body",
        ),
        (b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "messages[0].content"),
        (b'{"model": "\\udfff", "stream": true, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "body"),
        (b'{"messages": [{"role": "user", "content": "x"}', "body"),
        (b"\xff\xfe", "body"),
    ],
)
async def test_hostile_bodies_are_400s_naming_the_field(server: Server, raw: bytes, param: str) -> None:
    status, body = await server.post(raw)
    assert_openai_error(status, body, 400, param, "invalid_request")


async def test_an_image_too_thin_to_scale_is_a_400(server: Server) -> None:
    status, body = await server.post(user([image_part(1, 40_000)]))
    assert_openai_error(status, body, 400, "messages[0].content[0].image_url.url", "invalid_image")
    assert "1x40000" in body["error"]["message"]


async def test_a_prompt_over_max_model_len_is_a_400(server: Server) -> None:
    status, body = await server.post(user("word " * 1_500))
    assert_openai_error(status, body, 400, "messages", "context_length_exceeded")
    assert "max_model_len is 1024" in body["error"]["message"]
    # one 512x512 image is 1,056 tokens: over max_model_len too, whatever max_prompt_tokens says
    status, body = await server.post(user([image_part(512, 512)]))
    assert_openai_error(status, body, 400, "messages", "context_length_exceeded")


async def test_n_copies_that_can_never_fit_the_kv_cache_are_a_400(server: Server) -> None:
    # 16 sequences of a ~300-token prompt need over 4,800 tokens of a cache that holds 2,048
    status, body = await server.post({**user("word " * 300), "n": 16})
    assert_openai_error(status, body, 400, "n", "context_length_exceeded")
    status, body = await server.post({**user("word " * 300), "n": 2})  # two fit
    assert status == 200 and len(body["choices"]) == 2


async def test_model_names(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await server.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert isinstance(info.value.body, dict)
    assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")
    for name in ("m", "alias"):
        out = await server.client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        assert out.model == name
    assert [m.id for m in (await server.client.models.list()).data] == ["m", "alias"]


async def test_an_error_quotes_a_long_value_clipped(server: Server) -> None:
    """A 100 KB model name, a 400-digit max_tokens: the reply names them without echoing them whole."""
    status, body = await server.post({**user("x"), "model": "m" * 100_000})
    assert_openai_error(status, body, 404, "model", "model_not_found")
    message = body["error"]["message"]
    assert len(message) < 1_100 and "characters cut" in message and message.endswith("this server serves m, alias")
    status, body = await server.post(
        f'{{"messages": [{{"role": "user", "content": "x"}}], "max_tokens": {10**400}}}'.encode()
    )
    assert status == 400 and len(body["error"]["message"]) < 1_100


async def test_routing_errors_and_the_body_limit_are_openai_json(server: Server) -> None:
    status, body = await server.post({}, path="/v1/nothing")
    assert_openai_error(status, body, 404, None, "not_found")
    async with server.session.get(f"{server.base}/v1/chat/completions") as resp:
        assert_openai_error(resp.status, await resp.json(), 405, None, "method_not_allowed")
        assert resp.headers["Allow"] == "POST"
    status, body = await server.post(b"x" * (BODY_LIMIT + 1))
    assert_openai_error(status, body, 413, "body", "payload_too_large")


async def test_health_reports_decoding(server: Server) -> None:
    async with server.session.get(f"{server.base}/health") as resp:
        health = await resp.json()
    assert health["status"] == "ok"
    assert set(health["decoding"]) == {
        "running_seqs",
        "waiting_seqs",
        "kv_blocks_used",
        "kv_blocks_total",
        "preemptions",
    }
    assert health["decoding"]["kv_blocks_total"] == 128


async def test_metrics_through_prometheus_client(server: Server) -> None:
    status, _ = await server.post({**user("x"), "regex": "a+"})
    assert status == 200
    async with server.session.get(f"{server.base}/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families.values() for s in family.samples}
    # requests and preparation jobs are separate metrics (earlier tests in this module failed some)
    assert families["pipeline_requests"].type == families["pipeline_preparation_jobs"].type == "counter"
    assert value[("pipeline_requests_total", (("outcome", "completed"),))] >= 1
    assert value[("pipeline_preparation_jobs_total", (("outcome", "completed"),))] >= 1
    for name in ("pipeline_time_to_first_token_seconds", "pipeline_time_per_output_token_seconds"):
        assert families[name].type == "histogram" and value[(f"{name}_count", ())] >= 1
    assert value[("pipeline_engine_kv_blocks", ())] == 128
    assert value[("pipeline_engine_running_sequences", ())] == 0
    assert ("pipeline_engine_preemptions_total", ()) in value
    assert value[("pipeline_cache_misses_total", (("cache", "grammar"),))] >= 1
    # a spec's first use: llguidance stands in (xgrammar compiles from its second use on)
    assert value[("pipeline_grammar_compiles_total", (("backend", "llguidance"), ("reason", FIRST_USE)))] >= 1
    assert value[("pipeline_stage_completed_total", (("stage", "template"),))] >= 1


@pytest.mark.parametrize("extra", [{"temperature": 4.281702269685447e-85}, {"top_p": 1e-300, "temperature": 1}])
async def test_sampling_knobs_too_small_for_fp32_are_greedy(server: Server, extra: dict[str, float]) -> None:
    # found by the fuzzer: logits / 4e-85 in fp32 is a division by zero, and the NaN probabilities
    # sampled a token the grammar had masked (a 500)
    status, body = await server.post({**user(""), "choice": ["0", "1"], **extra})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] in ("0", "1")


async def test_openapi_json_is_served(server: Server) -> None:
    async with server.session.get(f"{server.base}/openapi.json") as resp:
        assert resp.status == 200 and await resp.json() == openapi_document()
