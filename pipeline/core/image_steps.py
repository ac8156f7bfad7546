"""The image part of a request's way through the stages: fetch and hash, decode, encode, with the
encoder cache in between.

Each image's bytes are hashed once, right after the fetch; the hash is its identity from then on.
A ``data:`` URL seen before skips the fetch (its base64 decode): its text's digest names its content
hash (stages/data_url_keys.py), and its bytes are decoded only if its image must be encoded after all
(no longer in the encoder cache when the request claims it).
At the decode step the request claims its images from the encoder cache (sorted by hash, one at a
time: see stages/encoder_cache.py): a hit skips decode, the processor and the encoder; a miss makes
the request the image's owner, and it decodes and encodes the image once for every request that asks
meanwhile. The owner's flights are abandoned when its job leaves the stages, whatever its outcome.
With the vision encoder in the engine process there is no encoder here: the cache keeps pixels, the
decode step hands them to the requests that wait, and they go to the engine process with the request
(pipeline/engine/images.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.core.staged import run_each
from pipeline.errors import InvalidRequest
from pipeline.observability.trace import Tracer
from pipeline.types import ImagePart
from sampling.inputs import ImageKey
from stages.content_hash import hash_off_loop
from stages.data_url_keys import DataUrlKeys, is_data_url, url_digest
from stages.decode import DecodeStage
from stages.encoder_cache import EncodedImage, EncoderCache, Flight
from stages.fetch import FetchStage
from stages.vision_encode import VisionEncodeStage
from vision.preprocess import PreparedImage

__all__ = ["ImageSteps", "RequestImages"]


@dataclass(eq=False)
class RequestImages:
    """One request's images as the steps fill them in, in prompt order."""

    # fetched bytes, freed once decoded; None: a data URL known by its text, not decoded (yet)
    data: list[bytes | None] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)  # content hash of each image
    images: list[PreparedImage | EncodedImage] = field(default_factory=list)
    flights: dict[str, Flight[Any]] = field(default_factory=dict)  # images this request encodes for others
    embeds: torch.Tensor | None = None  # [sum(num_patches), hidden]
    # the encoder in the engine process: each image's pixels, in prompt order (embeds is then None)
    pixels: list[torch.Tensor | None] = field(default_factory=list)
    keys: list[ImageKey] = field(default_factory=list)


class ImageSteps:
    def __init__(
        self,
        fetch: FetchStage,
        decode: DecodeStage,
        vision: VisionEncodeStage | None,
        cache: EncoderCache[Any] | None,
        tracer: Tracer | None,
        takes_images: bool,
    ) -> None:
        self.fetch = fetch
        self.decode = decode
        self.vision = vision  # None: the model takes no images, or (takes_images) the engine process encodes
        self.takes_images = takes_images
        self.cache = cache  # None: off
        # with no cache every image is decoded, so knowing its hash early saves nothing
        self.url_keys = DataUrlKeys() if cache is not None else None
        self.tracer = tracer

    async def fetch_step(self, refs: list[ImagePart], out: RequestImages, request_id: str) -> None:
        data: list[bytes | None] = [None] * len(refs)
        hashes = [""] * len(refs)
        limiter, keys = self.fetch.base64_limiter, self.url_keys
        slots = self.fetch.request_slots()  # this request's share of the fetch slots

        async def fetch_one(i: int) -> None:
            url = refs[i].url
            digest = None
            if keys is not None and is_data_url(url):
                digest = await url_digest(url, limiter)
                known = keys.get(digest)
                if known is not None:
                    hashes[i] = known
                    return
            data[i] = fetched = await self.fetch.run(url, field=refs[i].field, slots=slots)
            hashes[i] = await hash_off_loop(fetched, limiter)
            if keys is not None and digest is not None:
                keys.put(digest, hashes[i])

        await run_each(fetch_one, len(refs))
        out.data, out.hashes = data, hashes
        if self.tracer is not None and hashes:
            self.tracer.instant("images hashed", request_id, hashes=[h[:16] for h in hashes])

    async def decode_step(self, refs: list[ImagePart], out: RequestImages) -> None:
        found: dict[str, PreparedImage | EncodedImage] = {}
        if self.cache is not None:
            for h in sorted(set(out.hashes)):  # in hash order: no two requests wait on each other
                got = await self.cache.claim(h)
                if isinstance(got, Flight):
                    out.flights[h] = got
                else:
                    found[h] = got
        decoded: dict[str, PreparedImage] = {}  # by hash: an image twice in one request decodes once
        todo = list({h: i for i, h in reversed(list(enumerate(out.hashes))) if h not in found}.items())

        async def decode_one(k: int) -> None:
            h, i = todo[k]
            data = out.data[i]
            if data is None:  # known by its data URL, and not cached (any more): decode the URL now
                data = await self.fetch.run(refs[i].url, field=refs[i].field)
            decoded[h] = await self.decode.run(data, field=refs[i].field)

        await run_each(decode_one, len(todo))
        out.data = []  # the encoded bytes are no longer needed: free them early
        out.images = [found[h] if h in found else decoded[h] for h in out.hashes]
        if self.vision is None and self.cache is not None:  # the engine process encodes: pixels are all
            for h, image in decoded.items():  # the cache keeps, so those waiting have them now
                flight = out.flights.pop(h, None)
                if flight is not None:
                    self.cache.fulfil(flight, image)

    async def vision_step(self, out: RequestImages) -> None:
        if not out.images:
            return
        if not self.takes_images:
            raise InvalidRequest("this model takes no images", field="messages")
        if self.vision is None:
            self._pixels_for_engine(out)
            return
        todo = {h: im for h, im in zip(out.hashes, out.images, strict=True) if isinstance(im, PreparedImage)}
        encoded = await self.vision.encode_each(list(todo.values())) if todo else []
        done: dict[str, EncodedImage] = {}
        for (h, im), embeds in zip(todo.items(), encoded, strict=True):
            done[h] = EncodedImage(h, embeds, im.grid_thw)
            flight = out.flights.pop(h, None)
            if flight is not None and self.cache is not None:
                self.cache.fulfil(flight, done[h])
        images = [im if isinstance(im, EncodedImage) else done[h] for h, im in zip(out.hashes, out.images, strict=True)]
        # one image (the common case) is passed as it is, read-only from here on: a copy of its
        # megabytes on the loop cost more than anything else in this step
        out.embeds = images[0].embeds if len(images) == 1 else torch.cat([im.embeds for im in images])
        out.keys = [ImageKey(im.content_hash, im.num_patches, im.grid_thw) for im in images]
        out.images = []

    def _pixels_for_engine(self, out: RequestImages) -> None:
        """The engine process encodes: the request carries its images' pixels (the decode step gave
        those it decoded to the requests that waited for them)."""
        images = [im for im in out.images if isinstance(im, PreparedImage)]
        assert len(images) == len(out.images)  # no encoder here: nothing is cached encoded
        out.pixels = [im.pixel_values for im in images]
        out.keys = [ImageKey(h, im.num_patches, im.grid_thw) for h, im in zip(out.hashes, images, strict=True)]
        out.images = []

    def release(self, out: RequestImages) -> None:
        """Abandon the flights the request still owns (it failed or was cancelled before encoding)."""
        if self.cache is not None:
            for flight in out.flights.values():
                self.cache.abandon(flight)
        out.flights.clear()
