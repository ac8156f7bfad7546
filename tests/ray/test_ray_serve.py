"""The Ray Serve application on a local cluster: two replicas behind Ray's HTTP proxy, spoken to with
the real openai client, compared with the aiohttp server, and a replica killed under load.

One cluster serves the whole module (starting it takes about 20 s here); the replica-kill test runs
last because it changes which replicas there are.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import anyio
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import Pipeline, PipelineConfig
from pipeline.api.server import create_app
from tests.images import data_url, encode, image_request, make_image
from tests.servers import serving

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from pipeline.scaleout.ray_serve import APP_NAME, build_app, replica_ids  # noqa: E402  (needs ray)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "embedded-pixtral-tiny-s1234-v1"
# A bounded count: an unbounded integer lets a random-weight model write digits until max_tokens
# (about 1 answer in 200 unseeded).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}
# The default preparation mode: each replica's images are prepared in its worker processes, under the
# uvloop Serve runs its replicas on (one worker each keeps the start short). The engine on a thread:
# each replica starts seconds sooner, and the engine process's link on uvloop is test_engine_uvloop's.
CONFIG = PipelineConfig(prep_workers=1, engine_mode="thread")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(CONFIG, replicas=2), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_plain_and_streamed_chat(client: Any) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8, seed=3)
    answer = raw.parse()
    assert raw.headers["x-replica"]
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert answer.usage.completion_tokens <= 8

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, seed=3, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert text == answer.choices[0].message.content  # same seed, same answer, whichever replica


def test_guided_answer_validates(client: Any) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A thing and how many."}],
        max_tokens=64,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_completions_and_models(client: Any) -> None:
    answer = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    assert [m.id for m in client.models.list().data] == [MODEL]


async def _call(session: aiohttp.ClientSession, url: str, method: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.request(method, url, data=data if method == "POST" else None) as resp:
        payload = await resp.json(content_type=None)
        error = payload.get("error", {})
        return resp.status, (error.get("code"), error.get("param"), resp.headers.get("Allow"))


BAD = [
    ("POST", "/v1/chat/completions", b"{not json"),
    ("POST", "/v1/chat/completions", {"max_tokens": 4}),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/v1/chat/completions", image_request(["data:image/png;base64,!!!"], max_tokens=4)),
    ("POST", "/v1/chat/completions", image_request([data_url(b"just text", "image/png")], max_tokens=4)),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
    ),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("GET", "/v1/chat/completions", b""),
    ("POST", "/v1/models", b"{}"),
    ("GET", "/no/such/route", b""),
]


@pytest.mark.anyio
async def test_errors_are_the_aiohttp_servers_errors(base_url: str) -> None:
    """Same status, error code, named field and Allow header from both front ends."""
    async with (
        Pipeline(CONFIG) as pipe,
        serving(create_app(pipe)) as local,
        aiohttp.ClientSession() as session,
    ):
        for method, path, body in BAD:
            ours = await _call(session, local + path, method, body)
            theirs = await _call(session, base_url + path, method, body)
            assert ours[0] >= 400, (method, path, ours)
            assert theirs == ours, (method, path)


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def _metric(base_url: str, sample: str, by: str, **where: str) -> dict[str, float]:
    """``sample``'s values in the merged /metrics, summed by label ``by``, among samples with labels ``where``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(_get_text(base_url + "/metrics")):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in where.items()):
                out[s.labels[by]] = out.get(s.labels[by], 0) + s.value
    return out


def _encoder_hits(base_url: str) -> dict[str, float]:
    return _metric(base_url, "pipeline_cache_hits_total", "replica", cache="encoder")


def test_same_image_goes_to_the_same_replica_and_hits_its_cache(base_url: str, client: Any) -> None:
    before = _encoder_hits(base_url)
    where: dict[int, set[str]] = {}
    for seed in range(16):
        body = image_request([data_url(encode(make_image(seed=100 + seed)))], max_tokens=2)
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(model=MODEL, **body)
            where.setdefault(seed, set()).add(raw.headers["x-replica"])
    assert all(len(replicas) == 1 for replicas in where.values()), where  # both sends of an image: one replica
    per_replica = Counter(next(iter(r)) for r in where.values())
    assert len(per_replica) == 2, per_replica  # 16 images spread over both replicas
    after = _encoder_hits(base_url)
    gained = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    assert {r: n for r, n in gained.items() if n} == dict(per_replica)  # each second send hit its replica's cache


def _ingress_losses(base_url: str) -> dict[str, float]:
    return _metric(base_url, "pipeline_ingress_replica_losses_total", "outcome")


def _held(base_url: str) -> dict[str, int]:
    """Requests each replica holds now: in preparation, decoding, or waiting for a slot."""
    replicas = json.loads(_get_text(base_url + "/health"))["replicas"]
    return {
        name: r["pending"] + r["decoding"]["running_seqs"] + r["decoding"]["waiting_seqs"]
        for name, r in replicas.items()
    }


def test_health_reports_every_replica(base_url: str) -> None:
    health = json.loads(_get_text(base_url + "/health"))
    assert health["status"] == "ok"
    assert sorted(health["replicas"]) == sorted(r.rsplit("#", 1)[1] for r in replica_ids())
    assert all(r["status"] == "ok" for r in health["replicas"].values())


# -- a replica killed under load: runs last ------------------------------------------------------
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


async def _streamed(
    session: aiohttp.ClientSession, url: str, seed: int, started: anyio.Event, out: dict[str, Any]
) -> None:
    body = image_request(
        [data_url(encode(make_image(seed=seed)))], stream=True, stream_options={"include_usage": True}, **LONG
    )
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        out.update(status=resp.status, replica=resp.headers.get("X-Replica"), error=None, usage=None)
        events = 0
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            if events == 2:
                started.set()  # the first token is out: from now on a failure cannot be retried
            data = line[6:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            payload = json.loads(data)
            if "error" in payload:
                out["error"] = payload["error"]["code"]
            elif payload.get("usage"):
                out["usage"] = payload["usage"]["completion_tokens"]


async def _whole(session: aiohttp.ClientSession, url: str, seed: int) -> dict[str, Any]:
    body = image_request([data_url(encode(make_image(seed=seed)))], **LONG)
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        payload = await resp.json()
        error = payload.get("error", {}).get("code") if resp.status != 200 else None
        return {"status": resp.status, "replica": resp.headers.get("X-Replica"), "error": error}


@pytest.mark.anyio
async def test_a_replica_killed_under_load(base_url: str) -> None:
    """Streams that had begun on the killed replica end with an in-band replica_failed; whole answers
    it held are retried on the other replica; the other replica's requests are untouched; Serve
    brings a new replica up, which answers."""
    assert len(replica_ids()) == 2
    before = _ingress_losses(base_url)
    streams: list[dict[str, Any]] = [{} for _ in range(6)]  # filled as each stream goes
    ended: list[int] = []  # the streams whose task came back
    wholes: list[dict[str, Any]] = []
    with anyio.fail_after(240):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=200)) as session:
            started = [anyio.Event() for _ in range(6)]

            async def stream(i: int) -> None:
                await _streamed(session, base_url, 300 + i, started[i], streams[i])
                ended.append(i)

            async def whole(i: int) -> None:
                wholes.append(await _whole(session, base_url, 400 + i))

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(stream, i)
                for i in range(6):
                    tg.start_soon(whole, i)
                for event in started:
                    await event.wait()
                # the replica streaming the most: the kill surely cuts streams that had begun
                victim_name = Counter(s["replica"] for s in streams).most_common(1)[0][0]
                victim = next(r for r in replica_ids() if r.endswith("#" + victim_name))
                # every request is in a replica (400 tokens each: none ends meanwhile); the whole
                # answers the victim holds are those it holds beyond its streams
                while True:
                    held = await anyio.to_thread.run_sync(_held, base_url)
                    if sum(held.values()) == 12:
                        break
                    await anyio.sleep(0.2)  # noqa: sleep-ok: polls the replicas' /health; they give no event
                wholes_on_victim = held[victim_name] - sum(s["replica"] == victim_name for s in streams)
                ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    submitted = len(ended) + len(wholes)
    assert sorted(ended) == list(range(6)) and submitted == 12  # each request came back: none lost, none hung
    on_victim = [s for s in streams if s["replica"] == victim_name]
    survivors = [s for s in streams if s["replica"] != victim_name]
    assert all(s["status"] == 200 and s.get("done") for s in streams)
    assert all(s["error"] == "replica_failed" for s in on_victim)
    assert on_victim, streams
    assert all(s["error"] is None and s["usage"] == LONG["max_tokens"] for s in survivors)
    # whole answers never left the killed replica: retried on the survivor, all complete
    assert [w["status"] for w in wholes] == [200] * 6
    assert all(w["replica"] != victim_name for w in wholes)
    after = _ingress_losses(base_url)
    losses = {outcome: after[outcome] - before.get(outcome, 0) for outcome in after}
    assert losses["failed_mid_stream"] == len(on_victim)
    # each whole answer the victim held was retried, once: none met a second lost replica
    assert losses["retried"] == wholes_on_victim and losses["failed"] == 0
    print(
        f"accounting: {submitted} submitted; streams: {len(survivors)} completed, {len(on_victim)} ended with an "
        f"in-band replica_failed; whole answers: {len(wholes)} completed, {losses['retried']:.0f} of them retried "
        "after the kill; 0 lost"
    )

    # Serve replaces the replica; the application answers from both again
    with anyio.fail_after(120):
        while True:
            replicas = replica_ids()
            if len(replicas) == 2 and victim not in replicas:
                break
            await anyio.sleep(0.5)  # noqa: sleep-ok: polls Ray's actor list; it gives no event
    with anyio.fail_after(60):
        async with aiohttp.ClientSession() as session:
            result = await _whole(session, base_url, 999)
    assert result["status"] == 200
