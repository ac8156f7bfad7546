"""The vision encoder in the engine process, its two halves alone: the serving process's index decides
what the engine process holds, and the engine's half, obeying each add's plan, holds exactly that,
with every request's embeddings those of the encoder run on its images directly."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pipeline.engine.images import EngineImages, ImageIndex
from sampling.inputs import EngineInput, ImageKey
from sampling.params import SamplingParams
from tests.images import make_image
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder, embedding_row_bytes
from vision.preprocess import PreparedImage, preprocess_image


@pytest.fixture(scope="module")
def encoder(checkpoint: Checkpoint) -> VisionEncoder:
    return VisionEncoder(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def images(checkpoint: Checkpoint) -> dict[str, PreparedImage]:
    """Six images of four sizes, by a made-up content hash."""
    sizes = [(32, 32), (48, 32), (64, 48), (32, 64), (48, 48), (80, 32)]
    return {
        f"h{i}": preprocess_image(checkpoint.image_processor, make_image(w, h, seed=40 + i))
        for i, (w, h) in enumerate(sizes)
    }


def _input(request_id: str, hashes: list[str], images: dict[str, PreparedImage], image_token: int) -> EngineInput:
    keys = [ImageKey(h, images[h].num_patches, images[h].grid_thw) for h in hashes]
    prompt = [1] + [image_token] * sum(k.num_tokens for k in keys) + [2]
    pixels: list[torch.Tensor | None] = [images[h].pixel_values for h in hashes]
    return EngineInput(
        request_id, prompt, image_token, None, SamplingParams(max_tokens=1), image_keys=keys, image_pixels=pixels
    )


def test_the_row_size_is_the_encoders(checkpoint: Checkpoint, encoder: VisionEncoder) -> None:
    image = preprocess_image(checkpoint.image_processor, make_image(48, 32, seed=1))
    rows = encoder.encode([image])[0]
    assert rows.shape[0] == image.num_patches
    assert embedding_row_bytes(checkpoint, "cpu") == rows.shape[1] * rows.element_size()


def test_a_plan_sends_what_the_engine_lacks_keeps_what_fits_and_drops_the_least_recent() -> None:
    index = ImageIndex(max_bytes=100, row_bytes=10)  # ten rows
    a, b, c, big = (ImageKey(h, n) for h, n in (("a", 4), ("b", 4), ("c", 3), ("big", 11)))
    plan = index.plan([a, b, a], 1)  # an image twice in one add crosses once
    assert (plan.send, plan.keep, plan.drop) == ((True, True, False), (True, True, False), ())
    plan = index.plan([b], 2)
    assert (plan.send, plan.keep, plan.drop) == ((False,), (False,), ())
    plan = index.plan([c], 3)  # 11 rows held: the least recently used (a) goes
    assert (plan.send, plan.keep, plan.drop) == ((True,), (True,), ("a",))
    plan = index.plan([big], 4)  # heavier than the bound: encoded for this add alone
    assert (plan.send, plan.keep, plan.drop) == ((True,), (False,), ())
    assert (len(index), "b" in index, "a" in index, index.num_sent) == (2, True, False, 4)
    assert (index.stats.hits, index.stats.misses, index.stats.evictions) == (1, 4, 1)
    index.reset()  # a new engine process holds nothing
    assert len(index) == 0 and index.plan([b], 1).send == (True,)


def test_images_lost_are_forgotten_unless_sent_again_since() -> None:
    index = ImageIndex(max_bytes=100, row_bytes=10)
    a, b, wide = ImageKey("a", 4), ImageKey("b", 4), ImageKey("wide", 9)
    index.plan([a, b], 1)  # the engine failed to encode this add: it keeps neither
    index.forget(["a", "b"], 1)
    assert len(index) == 0 and index.stats.bytes_held == 0
    assert index.plan([a], 2).send == (True,)  # sent again
    index.plan([wide], 3)  # evicts a
    assert index.plan([a], 4).drop == ("wide",)  # a sent and kept again, by add 4
    index.forget(["a"], 2)  # news of add 2, late: add 4's a stays
    assert "a" in index and index.plan([a], 5).send == (False,)


def test_the_engine_holds_what_the_index_says_through_a_random_run(
    checkpoint: Checkpoint, encoder: VisionEncoder, images: dict[str, PreparedImage]
) -> None:
    row_bytes = embedding_row_bytes(checkpoint, "cpu")
    sizes = sorted(im.num_patches for im in images.values())
    # about two or three images fit: evictions, and an add whose own images evict each other
    index = ImageIndex(max_bytes=(sizes[-1] + sizes[-2] + sizes[0]) * row_bytes, row_bytes=row_bytes)
    engine = EngineImages(encoder, int(checkpoint.text_config.hidden_size))
    expected = {h: encoder.encode([im])[0] for h, im in images.items()}
    image_token = checkpoint.image_token_id
    assert image_token is not None
    rng = random.Random(7)
    for step in range(40):
        hashes = rng.choices(sorted(images), k=rng.randint(1, 4))
        inp = _input(f"r{step}", hashes, images, image_token)
        plan = index.plan(inp.image_keys, step + 1)
        # what crosses: only the pixels the plan sends
        sent = [p if send else None for p, send in zip(inp.image_pixels, plan.send, strict=True)]
        out = engine.resolve(EngineInput(**{**_fields(inp), "image_pixels": sent}), plan)
        assert out.image_pixels == [] and out.image_embeds is not None
        assert torch.equal(out.image_embeds, torch.cat([expected[h] for h in hashes]))
        assert sorted(engine.held) == sorted(h for h in images if h in index)
    assert index.stats.evictions > 0 and index.stats.hits > 0
    assert engine.num_encoded == index.num_sent


def test_an_image_that_fails_to_encode_changes_nothing_held(
    checkpoint: Checkpoint, encoder: VisionEncoder, images: dict[str, PreparedImage]
) -> None:
    row_bytes = embedding_row_bytes(checkpoint, "cpu")
    index = ImageIndex(max_bytes=1 << 30, row_bytes=row_bytes)
    engine = EngineImages(encoder, int(checkpoint.text_config.hidden_size))
    image_token = checkpoint.image_token_id
    assert image_token is not None
    inp = _input("bad", ["h0"], images, image_token)
    plan = index.plan(inp.image_keys, 1)
    broken = torch.zeros(1, 2, 3)  # no image of the grid its key says
    with pytest.raises(RuntimeError):
        engine.resolve(EngineInput(**{**_fields(inp), "image_pixels": [broken]}), plan)
    assert engine.held == {} and engine.num_encoded == 0
    index.forget(["h0"], 1)  # as the engine process says (ImagesLost)
    assert "h0" not in index
    # an add that counted on an image whose encode failed fails, and says why
    again = _input("again", ["h1", "h0"], images, image_token)
    plan = index.plan(again.image_keys, 2)
    stale = dataclasses.replace(plan, send=(True, False), keep=(True, False))  # as if sent before the news
    with pytest.raises(KeyError, match="not held here"):
        engine.resolve(again, stale)
    assert engine.held == {}


def _fields(inp: EngineInput) -> dict[str, object]:
    return {name: getattr(inp, name) for name in EngineInput.__dataclass_fields__ if not name.startswith("_")}


def test_an_add_that_fails_after_its_encode_keeps_nothing_and_still_drops(
    checkpoint: Checkpoint, encoder: VisionEncoder, images: dict[str, PreparedImage]
) -> None:
    """Its rows do not match its prompt (the input is checked once they are in): none of its images
    is kept, and what the index dropped with it is dropped."""
    row_bytes = embedding_row_bytes(checkpoint, "cpu")
    # either image fits alone, not both
    index = ImageIndex(
        max_bytes=max(images["h0"].num_patches, images["h2"].num_patches) * row_bytes, row_bytes=row_bytes
    )
    engine = EngineImages(encoder, int(checkpoint.text_config.hidden_size))
    image_token = checkpoint.image_token_id
    assert image_token is not None
    first = _input("first", ["h0"], images, image_token)
    engine.resolve(first, index.plan(first.image_keys, 1))
    assert sorted(engine.held) == ["h0"]
    inp = _input("short", ["h2"], images, image_token)  # too big to keep beside h0: h0 is dropped
    wrong = dataclasses.replace(inp.image_keys[0], num_tokens=inp.image_keys[0].num_tokens - 1)
    prompt = [1] + [image_token] * wrong.num_tokens + [2]
    short = EngineInput(**{**_fields(inp), "prompt_token_ids": prompt, "image_keys": [wrong]})
    plan = index.plan(short.image_keys, 2)
    assert plan.keep == (True,) and plan.drop == ("h0",)
    with pytest.raises(ValueError, match="embedding rows"):
        engine.resolve(short, plan)
    assert engine.held == {} and engine.num_encoded == 1
