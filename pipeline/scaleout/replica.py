"""One pipeline replica of the Ray Serve application: a ``Pipeline`` answering the API's routes.

A replica answers with ``pipeline.api.routes``: a head (status, headers) and then body chunks, so a
stream leaves it event by event and a whole answer in one piece; the ingress
(``pipeline.scaleout.ingress``) relays them. A replica returns from its constructor once its
preparation workers are up, and Serve's health check replaces one whose pipeline stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from pipeline.api.replies import Reply, StreamReply, error_reply
from pipeline.config import PipelineConfig
from pipeline.errors import PipelineError, RouteNotFound

__all__ = ["APP_NAME", "REPLICA_DEPLOYMENT", "Head", "PipelineReplica", "replica_ids"]

APP_NAME = "pipeline"
REPLICA_DEPLOYMENT = "PipelineReplica"
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
        from vision.heap import freeze_heap

        # Serve routes to a replica once its constructor returns: by then its workers are up (a
        # started pipeline's are), so a replacement does not make its first requests wait for them
        async with Pipeline(config) as pipe:
            freeze_heap()  # the replica's process is ours: its start's objects stay out of collections
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
