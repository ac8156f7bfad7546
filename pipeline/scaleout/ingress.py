"""The HTTP front of the Ray Serve application: everything that needs no model, then the request to a replica.

The ``Ingress`` checks routes, the body cap, the body deadline and the API key, computes the request's ``routing_key``
(``pipeline.scaleout.affinity``) and forwards the body to a replica (``pipeline.scaleout.replica``)
through a ``DeploymentHandle`` whose router (``pipeline.scaleout.router``) prefers the replica
holding that key's caches. A replica that dies before any byte of its answer left is retried once
on another; one that dies mid-stream ends the stream with an in-band ``ReplicaFailed`` error.
``/health`` and ``/metrics`` ask every replica and answer for all of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pipeline.api.auth import api_key_refusal
from pipeline.api.connections import ConnectionLimits
from pipeline.api.openapi import ROUTES, openapi_json
from pipeline.api.replies import DONE, Reply, error_reply, event, json_reply
from pipeline.errors import (
    InvalidRequest,
    MethodNotAllowed,
    Overloaded,
    PayloadTooLarge,
    PipelineError,
    ReplicaFailed,
    RouteNotFound,
)
from pipeline.scaleout.affinity import routing_key
from pipeline.scaleout.replica import replica_ids
from pipeline.scaleout.replica_metrics import merge_expositions

__all__ = ["FAN_OUT_TIMEOUT_S", "MAX_BODY_BYTES", "SERVER_LIMITS", "Ingress"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
FAN_OUT_TIMEOUT_S = 5.0  # /health and /metrics: a replica that does not answer by then is reported as such
_REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)
_SSE = "text/event-stream"
SERVER_LIMITS = ConnectionLimits()  # the aiohttp server's defaults, its body deadline's among them


def _to_response(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, headers=reply.headers)


def _error(error: PipelineError) -> Response:
    return _to_response(error_reply(error))


async def _read_body(request: Request, limit: int, timeout_s: float, rate: float) -> bytes:
    """The body, refused past ``limit`` bytes while it streams in (a wrong Content-Length cannot help),
    and refused (408) unless it arrives whole within ``timeout_s`` plus a second per ``rate`` bytes
    received: the aiohttp server's body deadline rule (pipeline/api/body_deadline.py), its clock started
    when the ingress starts reading (a wait in Ray's proxy before that is not counted). A body that
    stalls cannot hold an ingress request for good."""
    declared = request.headers.get("content-length")
    too_large = PayloadTooLarge(f"the request body is over the limit of {limit} bytes", field="body")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    started = asyncio.get_running_loop().time()
    body = bytearray()
    chunks = request.stream()
    try:
        while True:
            deadline = asyncio.timeout_at(started + timeout_s + len(body) / rate)
            try:
                async with deadline:
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return bytes(body)
            except TimeoutError:
                if not deadline.expired():  # Ray's own timeouts are TimeoutErrors too: not the client's
                    raise
                error = InvalidRequest(
                    f"the request body did not arrive whole within {timeout_s:g} s (and a second more per "
                    f"{rate:g} bytes received)",
                    field="body",
                    stage="http",
                )
                error.status = 408
                raise error from None
            body += chunk
            if len(body) > limit:
                raise too_large
    finally:
        await chunks.aclose()


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
        body_timeout_s: float = SERVER_LIMITS.body_timeout_s,
        body_timeout_rate: float = SERVER_LIMITS.body_timeout_rate,
    ) -> None:
        # checked as the aiohttp server checks them (positive), so a bad value fails the deployment, not each POST
        ConnectionLimits(body_timeout_s=body_timeout_s, body_timeout_rate=body_timeout_rate)
        self.replicas = replicas
        self.api_key, self.protect_all, self.max_body_bytes = api_key, protect_all, max_body_bytes
        self.body_timeout_s, self.body_timeout_rate = body_timeout_s, body_timeout_rate
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
            methods = "GET,HEAD" if allowed == "GET" else allowed  # HEAD is GET without the body, as in aiohttp
            response = _error(MethodNotAllowed(f"{request.method} is not allowed on {path} (allowed: {methods})"))
            response.headers["Allow"] = methods
            return response
        if path == "/openapi.json":
            return _to_response(Reply(200, openapi_json()))
        if path == "/health":
            return await self._health()
        if path == "/metrics":
            return await self._metrics()
        try:
            body = await _read_body(request, self.max_body_bytes, self.body_timeout_s, self.body_timeout_rate)
        except (PayloadTooLarge, InvalidRequest) as exc:  # over the cap, or past the deadline (408)
            response = _error(exc)
            response.headers["Connection"] = "close"  # the rest of the body is not read: the aiohttp server's way
            return response
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
