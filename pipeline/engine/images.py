"""The vision encoder in the engine process, and the cache of its embeddings beside it.

With ``vision_encoder_placement`` "engine" the serving process prepares an image up to its pixels and
the engine process encodes it, on the decoder's device, and keeps its embeddings for the next
request that shows it. The serving process decides what the engine process keeps and the engine
process obeys: ``ImageIndex`` (the serving process's, in ``ProcessEngine``) knows which images the
engine holds because it is the one that says so. Each add carries an ``ImagePlan``: per image, whether
its pixels cross (the engine does not hold it) and whether the engine keeps its embeddings, and which
held images the engine drops after this add. Commands cross one ordered socket, so when the engine
reads an add it holds exactly what the index said when the add was sent: no add refers to an image
the engine has dropped, and nothing is asked back. A request keeps its pixels until it has been sent
(and sent again, should its answer be resampled), so whatever the index decides meanwhile, an add can
always carry them. A new engine process holds nothing, and the index starts empty with it.

An add whose images fail to encode fails its request, and the engine process keeps none of them; it
says which it was told to keep (``ImagesLost``, with the add's command number), and the index forgets
each unless a later add has sent that image again. An add sent meanwhile that counts on one of them
fails its request too, with a message that says so.

``EngineImages`` is the engine process's half: it encodes what crosses and fills the request's
embeddings in (its DeepStack rows split off as the preparation stages do).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sampling.inputs import EngineInput, ImageKey
from stages.encoder_cache import CacheStats
from stages.lru import Lru
from vision.encoder import VisionEncoder, split_deepstack
from vision.preprocess import PreparedImage

__all__ = ["EngineImages", "ImageIndex", "ImagePlan"]


@dataclass(frozen=True, slots=True)
class ImagePlan:
    """What the engine process does with an add's images, one entry per image key."""

    send: tuple[bool, ...]  # its pixels cross with this add (False: held, or earlier in this add)
    keep: tuple[bool, ...]  # the engine keeps the embeddings it encodes of it
    drop: tuple[str, ...] = ()  # content hashes the engine drops once this add's images are in


class ImageIndex:
    """Which images' embeddings the engine process holds (the serving process's side; event loop only)."""

    def __init__(self, max_bytes: int, row_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.row_bytes = row_bytes  # one image token's embedding row in the engine process
        self.stats = CacheStats(bytes_bound=max_bytes)
        self._dropped: list[str] = []  # evicted since the last plan: the next add drops them
        self._held = self._new_held()
        self.num_sent = 0  # images whose pixels crossed

    def _new_held(self) -> Lru[str, tuple[int, int]]:
        """Per image held: its bytes there and the command number of the add that sent it."""
        return Lru(self.max_bytes, lambda entry: entry[0], on_evict=self._dropped.append)

    def __contains__(self, content_hash: object) -> bool:
        return content_hash in self._held

    def __len__(self) -> int:
        return len(self._held)

    def plan(self, keys: list[ImageKey], command: int) -> ImagePlan:
        """The plan of an add with images ``keys``, sent now as command number ``command``: from here
        on the index counts it done."""
        send: list[bool] = []
        keep: list[bool] = []
        in_add: set[str] = set()
        for key in keys:
            digest = key.content_hash
            if digest in in_add or self._held.get(digest) is not None:
                self.stats.hits += digest not in in_add
                send.append(False)
                keep.append(False)
                continue
            in_add.add(digest)
            nbytes = key.num_tokens * self.row_bytes
            fits = 0 < nbytes <= self.max_bytes
            self.stats.misses += 1
            send.append(True)
            keep.append(fits)
            if fits:  # evicts the least recently used (this add's own images last: they were touched)
                if digest in self._dropped:  # a hit of this add evicted by its own images, then sent again:
                    self._dropped.remove(digest)  # the engine keeps before it drops, so it must not drop it
                self._held.put(digest, (nbytes, command))
        drop, self._dropped[:] = tuple(self._dropped), []
        self.stats.evictions += len(drop)
        self.stats.bytes_held, self.stats.entries = self._held.weight, len(self._held)
        self.num_sent += sum(send)
        return ImagePlan(tuple(send), tuple(keep), drop)

    def forget(self, hashes: list[str], command: int) -> None:
        """The engine process did not keep ``hashes`` of add ``command`` (they failed to encode): forget
        those that no later add has sent again."""
        for digest in hashes:
            entry = self._held.peek(digest)
            if entry is not None and entry[1] == command:
                self._held.pop(digest)
        self.stats.bytes_held, self.stats.entries = self._held.weight, len(self._held)

    def reset(self) -> None:
        """A new engine process holds nothing."""
        self._held = self._new_held()
        self._dropped.clear()
        self.stats.bytes_held = self.stats.entries = 0


class EngineImages:
    """The engine process's encoder and the embeddings it holds, by content hash."""

    def __init__(self, encoder: VisionEncoder, hidden_size: int) -> None:
        self.encoder = encoder
        self.hidden_size = hidden_size  # the text model's: DeepStack rows are split off past it
        self.held: dict[str, torch.Tensor] = {}
        self.num_encoded = 0

    def resolve(self, inp: EngineInput, plan: ImagePlan) -> EngineInput:
        """``inp`` with its embeddings in (encoded here, or held), following ``plan``.

        :raises KeyError: the plan refers to an image this process does not hold (a bug).
        :raises Exception: the encoder failed (the request fails; what is held is unchanged).
        """
        keys = inp.image_keys
        todo = [i for i, send in enumerate(plan.send) if send]
        try:
            images = [PreparedImage(inp.image_pixels[i], _grid(keys[i])) for i in todo]
            encoded = dict(zip((keys[i].content_hash for i in todo), self.encoder.encode(images), strict=True))
            rows = [encoded[k.content_hash] if k.content_hash in encoded else self._held(k.content_hash) for k in keys]
            embeds, deepstack = split_deepstack(rows[0] if len(rows) == 1 else torch.cat(rows), self.hidden_size)
            extra = {"deepstack_visual_embeds": deepstack} if deepstack is not None else {}
            ready = dataclasses.replace(inp, image_embeds=embeds, image_pixels=[], extra_prefill=extra)
        except Exception:
            self._drop(plan.drop)  # what the index dropped goes whatever happened to the add
            raise
        # only now that the add is whole: a failed one keeps nothing (the index forgets what it kept)
        self.num_encoded += len(todo)
        for i, keep in enumerate(plan.keep):
            if keep:
                self.held[keys[i].content_hash] = encoded[keys[i].content_hash]
        self._drop(plan.drop)  # after keeping: an image kept and evicted within one add is not held
        return ready

    def _held(self, content_hash: str) -> torch.Tensor:
        held = self.held.get(content_hash)
        if held is None:
            raise KeyError(f"the embeddings of image {content_hash[:16]} are not held here (its encode failed)")
        return held

    def _drop(self, hashes: tuple[str, ...]) -> None:
        for digest in hashes:
            self.held.pop(digest, None)


def _grid(key: ImageKey) -> tuple[int, int, int]:
    if key.grid_thw is None:
        raise ValueError(f"image {key.content_hash[:16]} crossed without its token grid")
    return key.grid_thw
