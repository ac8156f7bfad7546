"""Vision encode: images of concurrent requests gathered into micro-batches, one thread hop each.

A batcher task takes the first waiting image, then gathers more for at most ``wait_ms`` or until
``max_batch``, and hands the batch to one worker-thread call. Inside that call the encoder runs the
tower once per image, not on the batch packed together: transformers packs a Pixtral batch into one
block-diagonal sequence, which measured 301 ms for 8 images against 57 ms one by one. What the
batch saves is the thread hops and limiter waits. Images whose requester has gone are skipped
before the batch runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.errors import PipelineError
from pipeline.outcome import Outcome
from stages.offload import Offload
from vision.encoder import VisionEncoder
from vision.preprocess import PreparedImage

__all__ = ["VisionEncodeStage"]


@dataclass(eq=False)
class _Pending:
    image: PreparedImage
    embeds: Outcome[torch.Tensor] = field(default_factory=Outcome)
    abandoned: bool = False


class VisionEncodeStage:
    name = "vision"

    def __init__(
        self,
        encoder: VisionEncoder,
        *,
        max_batch: int,
        wait_ms: float,
        queue_size: int,
        threads: int = 1,
        inline: bool = False,
    ) -> None:
        self.encoder = encoder
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000.0
        self.offload = Offload(anyio.CapacityLimiter(threads), inline=inline)
        self.limiter = self.offload.limiter
        self._send: MemoryObjectSendStream[_Pending]
        self._receive: MemoryObjectReceiveStream[_Pending]
        self._send, self._receive = anyio.create_memory_object_stream[_Pending](queue_size)
        self._batching = False  # run_batcher has started (it closes the receiving end)
        self.batch_sizes: list[int] = []

    @property
    def queue_depth(self) -> int:
        return self._send.statistics().current_buffer_used

    async def run_batcher(self) -> None:
        """Serve batches until the stream is closed; run it in the pipeline's task group.

        After the first image arrives, the batch is gathered only once an encoder thread is free (the
        limiter is taken on the batch's behalf), so images keep queueing, and batching, while every
        thread is busy.
        """
        self._batching = True
        async with self._receive, anyio.create_task_group() as encoders:
            while True:
                try:
                    first = await self._receive.receive()
                except anyio.EndOfStream:
                    return
                slot = object()
                await self.limiter.acquire_on_behalf_of(slot)
                encoders.start_soon(self._encode_batch, await self._gather(first), slot)

    async def _gather(self, first: _Pending) -> list[_Pending]:
        batch = [first]
        with anyio.move_on_after(self.wait_s):
            while len(batch) < self.max_batch:
                try:
                    batch.append(await self._receive.receive())
                except anyio.EndOfStream:  # closing: encode what we have
                    break
        while len(batch) < self.max_batch:  # take what is already queued, without waiting
            try:
                batch.append(self._receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        return batch

    async def wait_idle(self) -> None:
        """Return once no batch is being encoded (a cancelled request's batch finishes in its thread,
        holding its limiter token, after the request has left)."""
        while self.limiter.borrowed_tokens:
            async with self.limiter:  # one token frees: check again
                pass

    async def _encode_batch(self, batch: list[_Pending], slot: object) -> None:
        try:
            await self._encode([p for p in batch if not p.abandoned])
        finally:
            self.limiter.release_on_behalf_of(slot)
            for p in batch:  # skipped (abandoned) or not reached: nobody waits, but end them anyway
                p.embeds.fail(PipelineError("the image was not encoded", stage=self.name))

    def _encode_each(self, images: list[PreparedImage]) -> list[torch.Tensor | Exception]:
        """One worker-thread call for the batch; an image that fails fails only its own request."""
        out: list[torch.Tensor | Exception] = []
        for image in images:
            try:
                out.append(self.encoder.encode([image])[0])
            except Exception as exc:
                out.append(exc)
        return out

    async def _encode(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        self.batch_sizes.append(len(batch))
        with anyio.CancelScope(shield=True):  # the thread finishes anyway; wait for it
            # the batcher holds this batch's limiter token, so the thread call goes around the limiter
            results = await self.offload.run_holding_token(self._encode_each, [p.image for p in batch])
        for p, result in zip(batch, results, strict=True):
            if isinstance(result, Exception):
                p.embeds.fail(result)
            else:
                p.embeds.set_result(result)

    async def run(self, images: list[PreparedImage]) -> torch.Tensor | None:
        """Embeddings of all ``images`` stacked ``[sum(num_patches), hidden]``, or None without images.

        :raises PipelineError: (500) if the encoder failed on this batch.
        """
        if not images:
            return None
        return torch.cat(await self.encode_each(images))

    async def encode_each(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """One ``[num_patches, hidden]`` tensor per image (what the encoder cache keeps).

        :raises PipelineError: (500) if the encoder failed on this batch.
        """
        # images a preparation worker has encoded already pass through
        pending = {i: _Pending(im) for i, im in enumerate(images) if im.embeds is None}
        try:
            for p in pending.values():
                await self._send.send(p)  # blocks while the stage's inbox is full: backpressure
            for p in pending.values():
                await p.embeds.wait()
        except BaseException:
            for p in pending.values():
                p.abandoned = True
            raise
        errors = [p.embeds.error for p in pending.values() if p.embeds.error is not None]
        if errors:
            raise PipelineError(f"vision encoder failed: {errors[0]!r}", stage=self.name) from errors[0]
        return [pending[i].embeds.get() if i in pending else _embeds(im) for i, im in enumerate(images)]

    async def aclose(self) -> None:
        await self._send.aclose()  # the batcher ends once the queue is empty
        if not self._batching:
            self._receive.close()  # no batcher ran (its pipeline's start failed): nothing else closes it


def _embeds(image: PreparedImage) -> torch.Tensor:
    assert image.embeds is not None
    return image.embeds
