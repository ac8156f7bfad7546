"""/metrics and /health as an operator reads them: every family docs/server.md documents, with its
type, in a real exposition after real requests; and /health saying ``stopping`` while a shutdown
drains the requests in flight.

One pipeline for the module: the shutdown test is the last, and it leaves the pipeline stopped.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from pipeline import PipelineConfig
from pipeline.api.server import create_app
from pipeline.core.pipeline import Pipeline
from stages.grammar.types import FIRST_USE
from tests.images import data_url, encode, image_request, make_image
from tests.servers import serving

METRICS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "server.md"
NUM_KV_BLOCKS = 64
PNG = encode(make_image(64, 48, seed=3))

# Every family of the /metrics table of docs/server.md, as it spells it, with its Prometheus type.
TYPES = {
    "pipeline_requests_total": "counter",
    "pipeline_preparation_jobs_total": "counter",
    "pipeline_requests_pending": "gauge",
    "pipeline_requests_running": "gauge",
    "pipeline_requests_waiting_for_engine": "gauge",
    "pipeline_stage_queue_depth": "gauge",
    "pipeline_stage_in_flight": "gauge",
    "pipeline_stage_completed_total": "counter",
    "pipeline_stage_errors_total": "counter",
    "pipeline_stage_latency_seconds": "histogram",
    "pipeline_time_to_first_token_seconds": "histogram",
    "pipeline_time_per_output_token_seconds": "histogram",
    "pipeline_tokens_generated_total": "counter",
    "pipeline_engine_running_sequences": "gauge",
    "pipeline_engine_waiting_sequences": "gauge",
    "pipeline_engine_kv_blocks_used": "gauge",
    "pipeline_engine_kv_blocks": "gauge",
    "pipeline_engine_preemptions_total": "counter",
    "pipeline_grammar_compiles_total": "counter",
    "pipeline_grammar_errors_total": "counter",
    "pipeline_grammar_timeouts_total": "counter",
    "pipeline_grammar_compile_seconds_total": "counter",
    "pipeline_grammar_compiling": "gauge",
    "pipeline_cache_hits_total": "counter",
    "pipeline_cache_misses_total": "counter",
    "pipeline_cache_evictions_total": "counter",
    "pipeline_cache_bytes": "gauge",
    "pipeline_cache_bytes_bound": "gauge",
    "pipeline_cache_entries": "gauge",
    "pipeline_answer_checks_total": "counter",
    "pipeline_answer_resamples_total": "counter",
}


def documented_metrics() -> set[str]:
    """The metric names of the /metrics table in docs/server.md; ``_in_flight`` after ``pipeline_stage_queue_depth``
    stands for ``pipeline_stage_in_flight``."""
    text = METRICS_PAGE.read_text()
    table = text[text.index("**`/metrics`**") :].split("\n\n")[1]
    names: set[str] = set()
    for row in table.splitlines()[2:]:
        spelled = [name.split("{")[0] for name in re.findall(r"`([^`]+)`", row.split("|")[1])]
        prefix = "_".join(spelled[0].split("_")[:2])
        names |= {prefix + name if name.startswith("_") else name for name in spelled}
    return names


@dataclass
class Served:
    pipe: Pipeline
    base: str
    session: aiohttp.ClientSession
    image_url: str
    image_asked: anyio.Event
    image_gate: anyio.Event  # the image server answers once it is set

    async def post(self, body: dict[str, Any]) -> tuple[int, Any, str | None]:
        async with self.session.post(f"{self.base}/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.json(), resp.headers.get("Retry-After")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[Served]:
    images = web.Application()
    asked, gate = anyio.Event(), anyio.Event()
    gate.set()  # open until the shutdown test holds an image back

    async def image(_: web.Request) -> web.Response:
        served.image_asked.set()
        await served.image_gate.wait()
        return web.Response(body=PNG, content_type="image/png")

    images.router.add_get("/held.png", image)
    config = PipelineConfig(
        allow_private_networks=True,
        max_running_seqs=4,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=512,
        engine_mode="thread",
    )
    async with (
        serving(images) as image_base,
        Pipeline(config) as pipe,
        serving(create_app(pipe), handler_cancellation=True) as base,
        aiohttp.ClientSession() as session,
    ):
        served = Served(pipe, base, session, f"{image_base}/held.png", asked, gate)
        yield served


async def scrape(served: Served) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """The exposition's families (name -> type) and samples ((name, labels) -> value)."""
    async with served.session.get(f"{served.base}/metrics") as resp:
        assert resp.status == 200
        families = list(text_string_to_metric_families(await resp.text()))
    types = {family.name: family.type for family in families}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}
    return types, values


def test_the_readme_table_is_the_list_checked() -> None:
    assert documented_metrics() == set(TYPES)


async def test_every_documented_family_is_exported_with_its_type(served: Served) -> None:
    answered = image_request([data_url(PNG)], guided_choice=["yes", "no"], max_tokens=4)
    status, body, _ = await served.post(answered)
    assert status == 200, body
    tokens = body["usage"]["completion_tokens"]
    status, body, _ = await served.post(image_request([data_url(b"not an image")]))
    assert (status, body["error"]["code"]) == (400, "invalid_image")
    await served.pipe.preparation.grammar.wait_idle()  # no compile left running to count later
    types, values = await scrape(served)
    for name, kind in TYPES.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert types.get(family) == kind, (name, types.get(family))

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted(labels.items())))]

    # what the two requests left behind, one sample of each kind of family
    assert [value("pipeline_requests_total", outcome=o) for o in ("completed", "failed", "cancelled", "refused")] == [
        1,
        1,
        0,
        0,
    ]
    assert value("pipeline_preparation_jobs_total", outcome="failed") == 1
    assert value("pipeline_requests_pending") == value("pipeline_requests_running") == 0
    assert value("pipeline_requests_waiting_for_engine") == 0
    for stage in ("fetch", "decode", "template", "vision"):
        assert value("pipeline_stage_queue_depth", stage=stage) == value("pipeline_stage_in_flight", stage=stage) == 0
        assert value("pipeline_stage_latency_seconds_count", stage=stage) >= 1
    assert value("pipeline_stage_completed_total", stage="vision") == 1
    assert value("pipeline_stage_errors_total", stage="decode", type="ImageDecodeError") == 1
    assert value("pipeline_time_to_first_token_seconds_count") == 1
    assert value("pipeline_tokens_generated_total") == tokens
    assert value("pipeline_engine_kv_blocks") == NUM_KV_BLOCKS and value("pipeline_engine_running_sequences") == 0
    # the choice's first use: llguidance stands in, and no xgrammar compile starts
    assert value("pipeline_grammar_compiles_total", backend="llguidance", reason=FIRST_USE) == 1
    compiles = [labels for (name, labels) in values if name == "pipeline_grammar_compiles_total"]
    assert not [labels for labels in compiles if ("backend", "xgrammar") in labels]
    # both images missed the encoder cache; only the one that decoded is kept
    assert (
        value("pipeline_cache_misses_total", cache="encoder") == 2
        and value("pipeline_cache_entries", cache="encoder") == 1
    )
    assert value("pipeline_cache_bytes_bound", cache="kv_prefix") > 0
    assert {labels for (name, labels) in values if name == "pipeline_cache_hits_total"} == {
        (("cache", c),) for c in ("encoder", "grammar", "kv_prefix")
    }
    assert sum(v for (name, labels), v in values.items() if name == "pipeline_answer_checks_total") == 1


async def test_health_says_stopping_while_the_shutdown_drains(served: Served) -> None:
    """The server's shutdown: no new requests (503), /health 503 ``stopping``, those in flight finish."""
    pipe = served.pipe
    served.image_gate, served.image_asked = anyio.Event(), anyio.Event()  # hold the next image back
    results: list[tuple[int, Any, str | None]] = []
    drained: list[bool] = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:

            async def in_flight() -> None:
                results.append(await served.post(image_request([served.image_url], max_tokens=2)))

            async def drain() -> None:
                drained.append(await pipe.drain(30))

            tg.start_soon(in_flight)
            await served.image_asked.wait()  # admitted, and held in the fetch stage
            pipe.stop_accepting()
            tg.start_soon(drain)
            async with served.session.get(f"{served.base}/health") as resp:
                assert resp.status == 503
                assert await resp.json() == {
                    "status": "stopping",
                    "engine": "ok",
                    "pending": 1,
                    "decoding": pipe.decoding(),
                }
            status, body, retry_after = await served.post(image_request([data_url(PNG)]))
            assert (status, body["error"]["code"], retry_after) == (503, "shutting_down", "1")
            assert not drained  # the request in flight holds the drain
            served.image_gate.set()
    assert drained == [True]
    status, body, _ = results[0]
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    async with served.session.get(f"{served.base}/health") as resp:
        assert resp.status == 503 and (await resp.json())["status"] == "stopping"
