"""The pipeline as a Ray Serve application: one ingress, N replicas each owning a ``Pipeline``.

    HTTP ─▶ Ray's proxy ─▶ Ingress ──(AffinityRouter)──▶ PipelineReplica × N ─▶ pipeline.api.routes
              (any node)    body cap, API key, routes,     preparation + engine, the same
                            routing key, retry, fan-out    parsing, errors and streams as aiohttp

- ``Ingress`` checks what needs no model (routes, body cap, API key), computes the request's
  ``routing_key`` (``pipeline.scaleout.affinity``) and forwards the body to a replica through a
  ``DeploymentHandle`` whose router (``pipeline.scaleout.router``) prefers the replica holding that
  key's caches. ``/health`` and ``/metrics`` ask every replica and answer for all of them.
- ``PipelineReplica`` answers with ``pipeline.api.routes``: a head (status, headers) and then body chunks,
  so a stream leaves a replica event by event and a whole answer in one piece.
- A replica that dies before any byte of its answer left is retried once on another replica; one
  that dies mid-stream ends the stream with an in-band ``ReplicaFailed`` error. Ray Serve's
  controller starts a new replica in its place.
- Everything is bounded: a replica admits ``max_pending_requests`` at once and refuses more with its
  429, as the aiohttp server does; the ingress queues at most as many again per replica while
  every replica is full, then refuses with 429 and ``Retry-After``.

``python -m pipeline serve --ray --replicas N`` runs it; ``serve run pipeline.scaleout.ray_serve:app`` (or a
Serve config file with ``import_path: pipeline.scaleout.ray_serve:app``) runs two replicas with the default
configuration, and ``pipeline.scaleout.ray_serve:build`` takes the same options as arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pipeline.api.auth import api_key_refusal
from pipeline.api.openapi import ROUTES, openapi_json
from pipeline.api.replies import DONE, Reply, StreamReply, error_reply, event, json_reply
from pipeline.config import PipelineConfig
from pipeline.errors import (
    MethodNotAllowed,
    Overloaded,
    PayloadTooLarge,
    PipelineError,
    ReplicaFailed,
    RouteNotFound,
)
from pipeline.scaleout.affinity import routing_key
from pipeline.scaleout.replica_metrics import merge_expositions

__all__ = ["APP_NAME", "Ingress", "PipelineReplica", "app", "build", "build_app", "replica_ids"]

logger = logging.getLogger(__name__)

APP_NAME = "pipeline"
REPLICA_DEPLOYMENT = "PipelineReplica"
MAX_BODY_BYTES = 64 * 1024 * 1024
FAN_OUT_ROOM = 8
FAN_OUT_TIMEOUT_S = 5.0  # /health and /metrics: a replica that does not answer by then is reported as such
_REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)
_SSE = "text/event-stream"
_END = object()
Head = tuple[int, dict[str, str]]


class PipelineReplica:
    """One ``Pipeline`` (preparation and engine) answering the API's routes for the ingress."""

    async def __init__(self, config: PipelineConfig, shutdown_timeout: float = 30.0) -> None:  # type: ignore[misc]  # Serve awaits it
        self.name = serve.get_replica_context().replica_id.unique_id
        self._shutdown_timeout = shutdown_timeout
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        # The pipeline's task groups must be entered and left by one task: this one lives as long
        # as the replica, and __del__ ends it.
        self._owner = asyncio.create_task(self._own(config, ready))
        waiting = asyncio.create_task(ready.wait())
        await asyncio.wait({self._owner, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if self._owner.done():
            self._owner.result()  # the pipeline failed to start: raise why

    async def _own(self, config: PipelineConfig, ready: asyncio.Event) -> None:
        from pipeline.api.routes import Api
        from pipeline.core.pipeline import Pipeline

        async with Pipeline(config) as pipe:
            # Serve routes to a replica once its constructor returns: by then its workers are up,
            # so a replacement does not make its first requests wait for them
            await pipe.preparation.start_workers()
            self.pipe, self.api = pipe, Api(pipe)
            ready.set()
            await self._stop.wait()
            pipe.stop_accepting()
            await pipe.drain(self._shutdown_timeout)

    async def __del__(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            await self._owner

    def check_health(self) -> None:
        """Serve's health check: a replica whose pipeline stopped is replaced."""
        if self._owner.done():
            raise RuntimeError(f"the pipeline of replica {self.name} stopped")

    async def answer(
        self, method: str, path: str, body: bytes, *, routing_key: str | None = None, replica: str | None = None
    ) -> AsyncIterator[Head | bytes]:
        """Answer one API call: first its head (status, headers), then its body chunks.
        (``routing_key`` and ``replica`` are read by the router on the way here.)"""
        call = self.api.route(method, path)
        reply = await call(body) if call is not None else error_reply(RouteNotFound(f"no route {method} {path}"))
        parts = self._stream(reply) if isinstance(reply, StreamReply) else self._whole(reply)
        async for part in parts:
            yield part

    async def _whole(self, reply: Reply) -> AsyncIterator[Head | bytes]:
        yield reply.status, {**reply.headers, "X-Replica": self.name}
        yield reply.body

    async def _stream(self, reply: StreamReply) -> AsyncIterator[Head | bytes]:
        """A ``StreamReply`` as chunks: its head waits for the first event, so an error before it is
        still a plain 4xx. Bounded: a slow reader slows the writer. Any other exception is raised
        here, and the ingress answers it (a 500 before the first event)."""
        chunks: asyncio.Queue[Any] = asyncio.Queue(maxsize=8)

        async def write() -> None:
            try:
                await reply.write(chunks.put)
            except BaseException as exc:
                with contextlib.suppress(asyncio.QueueFull):  # a reader that left reads nothing more
                    chunks.put_nowait(exc)
                raise
            await chunks.put(_END)

        writer = asyncio.create_task(write())
        try:
            item = await chunks.get()
            if isinstance(item, PipelineError):  # raised before the first event
                async for part in self._whole(error_reply(item)):
                    yield part
                return
            yield 200, {**reply.headers, "X-Replica": self.name}
            while item is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
                item = await chunks.get()
        finally:
            if not writer.done():  # the ingress went away: cancelling the writer cancels the requests
                writer.cancel()
            with contextlib.suppress(BaseException):
                await writer


def replica_ids(app_name: str = APP_NAME) -> list[str]:
    """The full ids of the application's pipeline replicas alive now: Serve names each replica's
    actor by its id (``SERVE_REPLICA::app#PipelineReplica#id``); a starting one is listed too."""
    prefix = f"SERVE_REPLICA::{app_name}#{REPLICA_DEPLOYMENT}#"
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in names if a["name"].startswith(prefix))


def _to_response(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, headers=reply.headers)


def _error(error: PipelineError) -> Response:
    return _to_response(error_reply(error))


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused past ``limit`` bytes while it streams in (a wrong Content-Length cannot help)."""
    declared = request.headers.get("content-length")
    too_large = PayloadTooLarge(f"the request body is over the limit of {limit} bytes", field="body")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


_METHODS = {route.path: route.method.upper() for route in ROUTES}


class Ingress:
    """The HTTP front: everything that needs no model, then the request to a replica."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        *,
        api_key: str | None = None,
        protect_all: bool = False,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.replicas = replicas
        self.api_key, self.protect_all, self.max_body_bytes = api_key, protect_all, max_body_bytes
        context = serve.get_replica_context()
        self.app_name, self.name = context.app_name, context.replica_id.unique_id
        self.registry = CollectorRegistry()
        self.replica_losses = PromCounter(
            "pipeline_ingress_replica_losses",
            "replicas lost while they held a request, by what became of it",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("retried", "failed", "failed_mid_stream"):
            self.replica_losses.labels(outcome)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        method = "GET" if request.method == "HEAD" else request.method
        if self.api_key:
            refusal = api_key_refusal(
                self.api_key, path, request.headers.get("authorization"), protect_all=self.protect_all
            )
            if refusal is not None:
                return _to_response(refusal)
        allowed = _METHODS.get(path)
        if allowed is None:
            return _error(RouteNotFound(f"no route {request.method} {path}"))
        if method != allowed:
            response = _error(MethodNotAllowed(f"{request.method} is not allowed on {path} (allowed: {allowed})"))
            response.headers["Allow"] = allowed
            return response
        if path == "/openapi.json":
            return _to_response(Reply(200, openapi_json()))
        if path == "/health":
            return await self._health()
        if path == "/metrics":
            return await self._metrics()
        try:
            body = await _read_body(request, self.max_body_bytes)
        except PayloadTooLarge as exc:
            return _error(exc)
        key = routing_key(body) if method == "POST" else None
        return await self._forward(method, path, body, key)

    # -- one request to one replica --------------------------------------------------------------
    def _call(self, method: str, path: str, body: bytes, **route: str | None) -> DeploymentResponseGenerator:
        answer = self.replicas.options(stream=True).answer.remote(method, path, body, **route)
        assert isinstance(answer, DeploymentResponseGenerator)
        return answer

    @staticmethod
    async def _head(answer: DeploymentResponseGenerator) -> tuple[int, dict[str, str], bytes]:
        """A replica's status, headers and first body chunk (a whole answer's only one)."""
        status, headers = await answer.__anext__()
        return status, headers, await answer.__anext__()

    async def _forward(self, method: str, path: str, body: bytes, key: str | None) -> Response:
        for attempt in (1, 2):
            answer = self._call(method, path, body, routing_key=key)
            try:
                status, headers, first = await self._head(answer)
            except _REPLICA_GONE as exc:
                answer.cancel()
                if attempt == 1:  # nothing has left yet: another replica may answer it whole
                    logger.warning("replica lost before answering %s %s (%s); retrying once", method, path, exc)
                    self.replica_losses.labels("retried").inc()
                    continue
                self.replica_losses.labels("failed").inc()
                return _error(ReplicaFailed(f"the replica serving the request failed twice ({type(exc).__name__})"))
            except BackPressureError as exc:
                answer.cancel()
                retry = exc.retry_after_s or 1.0
                return _error(Overloaded(f"every replica is full: {exc.message}", retry_after=retry))
            except asyncio.CancelledError:
                answer.cancel()  # the client went away: the replica cancels the request
                raise
            except Exception as exc:  # a bug in a replica: a 500 in OpenAI's shape, logged once
                answer.cancel()
                logger.exception("%s %s failed in its replica", method, path)
                return _error(PipelineError(f"internal error ({type(exc).__name__})"))
            if not headers.get("Content-Type", "").startswith(_SSE):
                answer.cancel()
                return Response(first, status_code=status, headers=headers)
            return StreamingResponse(self._relay(first, answer), status_code=status, headers=headers)
        raise AssertionError("unreachable")

    async def _relay(self, first: bytes, answer: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in answer:
                yield chunk
        except _REPLICA_GONE as exc:
            logger.warning("replica lost mid-stream (%s)", exc)
            self.replica_losses.labels("failed_mid_stream").inc()
            error = ReplicaFailed(f"the replica serving the request failed mid-stream ({type(exc).__name__})")
            yield event({"error": error.to_dict()})  # headers are gone: in-band, as OpenAI does
            yield DONE
        finally:
            answer.cancel()  # a client that went away cancels the replica's request

    # -- every replica ---------------------------------------------------------------------------
    async def _ask_each(self, method: str, path: str) -> dict[str, tuple[int, bytes] | str]:
        """Each replica's answer (status, body), or why there is none: "starting" or "unreachable"."""

        async def ask(replica: str) -> tuple[int, bytes] | str:
            answer = self._call(method, path, b"", replica=replica)
            try:
                async with asyncio.timeout(FAN_OUT_TIMEOUT_S):
                    status, headers, body = await self._head(answer)
            except (TimeoutError, *_REPLICA_GONE) as exc:
                logger.warning("replica %s did not answer %s %s: %r", replica, method, path, exc)
                return "unreachable"
            finally:
                answer.cancel()
            # another replica answered: this one is not running yet (or no longer)
            return (status, body) if replica.endswith("#" + headers.get("X-Replica", "")) else "starting"

        # One after another: calls made for one HTTP request share its Serve request id, and Serve's
        # router matches concurrent ones to replicas by that id (seen with Ray 2.60: each then waits
        # for the other's replica).
        return {r.rsplit("#", 1)[1]: await ask(r) for r in replica_ids(self.app_name)}

    async def _health(self) -> Response:
        """200 while at least one replica can take requests; every replica's own answer within."""
        replicas: dict[str, Any] = {}
        for name, answer in (await self._ask_each("GET", "/health")).items():
            replicas[name] = json.loads(answer[1]) if isinstance(answer, tuple) else {"status": answer}
        ok = any(r.get("status") == "ok" for r in replicas.values())
        return _to_response(
            json_reply({"status": "ok" if ok else "unavailable", "replicas": replicas}, 200 if ok else 503)
        )

    async def _metrics(self) -> Response:
        parts = {name: a[1] for name, a in (await self._ask_each("GET", "/metrics")).items() if isinstance(a, tuple)}
        parts[f"ingress:{self.name}"] = generate_latest(self.registry)  # this ingress's own counters
        return Response(merge_expositions(parts), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(
    config: PipelineConfig | None = None,
    *,
    replicas: int = 2,
    replica_cpus: float = 1.0,
    api_key: str | None = None,
    protect_all: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    busy_slack: int = 4,
    shutdown_timeout: float = 30.0,
) -> serve.Application:
    """The Serve application: ``replicas`` pipelines behind one ingress (``serve.run`` it)."""
    config = config or PipelineConfig()
    per_replica = config.max_pending_requests
    replica = serve.deployment(name=REPLICA_DEPLOYMENT)(PipelineReplica).options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus},
        # room above the pipeline's own admission bound for /health and /metrics of a full replica;
        # requests past the bound get the pipeline's 429
        max_ongoing_requests=per_replica + FAN_OUT_ROOM,
        # every replica full and as many again waiting in the ingress: then 429 (rule 2)
        max_queued_requests=replicas * per_replica,
        request_router_config=RequestRouterConfig(
            request_router_class="pipeline.scaleout.router.AffinityRouter",  # type: ignore[arg-type]  # a path is allowed
            request_router_kwargs={"busy_slack": busy_slack},
        ),
        health_check_period_s=2,
        graceful_shutdown_timeout_s=shutdown_timeout + 5,
    )
    ingress = serve.deployment(name="Ingress")(Ingress).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=3 * replicas * per_replica
    )
    return ingress.bind(
        replica.bind(config, shutdown_timeout),
        api_key=api_key,
        protect_all=protect_all,
        max_body_bytes=max_body_bytes,
    )


def build(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder (``serve run pipeline.scaleout.ray_serve:build replicas=4 ...``): ``replicas``,
    ``replica_cpus``, ``api_key`` and any ``PipelineConfig`` field by name."""
    fields = {f.name: f for f in dataclasses.fields(PipelineConfig)}
    options = {k: v for k, v in args.items() if k not in fields}
    config = PipelineConfig(**{k: v for k, v in args.items() if k in fields})
    if "replicas" in options:
        options["replicas"] = int(options["replicas"])
    if "replica_cpus" in options:
        options["replica_cpus"] = float(options["replica_cpus"])
    options.setdefault("api_key", os.environ.get("PIPELINE_API_KEY"))
    return build_app(config, **options)


app = build_app()
