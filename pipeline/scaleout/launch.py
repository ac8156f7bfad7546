"""``python -m pipeline serve --ray``: start or join a Ray cluster, run the Serve application, and
take it down on SIGINT/SIGTERM (requests in flight finish first, within ``--shutdown-timeout``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from pipeline.config import PipelineConfig

__all__ = ["serve_on_ray"]


def serve_on_ray(
    args: argparse.Namespace,
    config: PipelineConfig,
    send_demo: Callable[[int], Coroutine[Any, Any, None]] | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; ``send_demo(port)`` runs once the application is up (``--demo``, ``--once``)."""
    import ray
    from ray import serve

    from pipeline.api.auth import resolve_api_key
    from pipeline.scaleout.ray_serve import APP_NAME, build_app

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # a local cluster with room for the replicas (the ingress and Serve's actors take no CPU)
        ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas * args.replica_cpus), include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app(
            config,
            replicas=args.replicas,
            replica_cpus=args.replica_cpus,
            api_key=resolve_api_key(args.api_key),
            protect_all=args.api_key_everywhere,
            shutdown_timeout=args.shutdown_timeout,
            body_timeout_s=args.body_timeout,
            body_timeout_rate=args.body_timeout_rate,
        )
        print(f"starting {args.replicas} replicas on Ray ...", flush=True)
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"serving on http://{args.host}:{args.port} with {args.replicas} Ray Serve replicas", flush=True)
        if send_demo is not None:
            asyncio.run(send_demo(args.port))
        if not args.once:
            stop.wait()
            print("shutting down: no new requests; finishing those in flight", flush=True)
        serve.delete(APP_NAME)  # each replica drains its pipeline (__del__)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
