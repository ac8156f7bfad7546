"""The pipeline as a Ray Serve application: one ingress, N replicas each owning a ``Pipeline``.

    HTTP ─▶ Ray's proxy ─▶ Ingress ──(AffinityRouter)──▶ PipelineReplica × N ─▶ pipeline.api.routes
              (any node)    body cap, API key, routes,     preparation + engine, the same
                            routing key, retry, fan-out    parsing, errors and streams as aiohttp

This module assembles the two deployments (``build_app``); each has its own module:

- ``Ingress`` (``pipeline.scaleout.ingress``) checks what needs no model (routes, body cap, API
  key), computes the request's ``routing_key`` (``pipeline.scaleout.affinity``) and forwards the
  body to a replica through a ``DeploymentHandle`` whose router (``pipeline.scaleout.router``)
  prefers the replica holding that key's caches. ``/health`` and ``/metrics`` ask every replica
  and answer for all of them.
- ``PipelineReplica`` (``pipeline.scaleout.replica``) answers with ``pipeline.api.routes``: a head
  (status, headers) and then body chunks, so a stream leaves a replica event by event and a whole
  answer in one piece.
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

import dataclasses
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from pipeline.api.connections import ConnectionLimits
from pipeline.config import PipelineConfig
from pipeline.scaleout.ingress import MAX_BODY_BYTES, SERVER_LIMITS, Ingress
from pipeline.scaleout.replica import APP_NAME, REPLICA_DEPLOYMENT, PipelineReplica, replica_ids

__all__ = ["APP_NAME", "Ingress", "PipelineReplica", "app", "build", "build_app", "replica_ids"]

FAN_OUT_ROOM = 8  # a replica's room above its admission bound, for /health and /metrics


def build_app(
    config: PipelineConfig | None = None,
    *,
    replicas: int = 2,
    replica_cpus: float = 1.0,
    api_key: str | None = None,
    protect_all: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = SERVER_LIMITS.body_timeout_s,
    body_timeout_rate: float = SERVER_LIMITS.body_timeout_rate,
    busy_slack: int = 4,
    shutdown_timeout: float = 30.0,
) -> serve.Application:
    """The Serve application: ``replicas`` pipelines behind one ingress (``serve.run`` it); a request
    body must reach the ingress within ``body_timeout_s`` plus a second per ``body_timeout_rate`` bytes
    (as ``serve --body-timeout``, ``--body-timeout-rate``)."""
    config = config or PipelineConfig()
    ConnectionLimits(body_timeout_s=body_timeout_s, body_timeout_rate=body_timeout_rate)  # positive, or ValueError
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
        body_timeout_s=body_timeout_s,
        body_timeout_rate=body_timeout_rate,
    )


def build(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder (``serve run pipeline.scaleout.ray_serve:build replicas=4 ...``): ``replicas``,
    ``replica_cpus``, ``api_key`` and any ``PipelineConfig`` field by name."""
    fields = {f.name: f for f in dataclasses.fields(PipelineConfig)}
    options = {k: v for k, v in args.items() if k not in fields}
    config = PipelineConfig(**{k: v for k, v in args.items() if k in fields})
    if "replicas" in options:
        options["replicas"] = int(options["replicas"])
    for name in ("replica_cpus", "body_timeout_s", "body_timeout_rate"):
        if name in options:
            options[name] = float(options[name])
    options.setdefault("api_key", os.environ.get("PIPELINE_API_KEY"))
    return build_app(config, **options)


app = build_app()
