"""Seeded fuzz of image bytes: whatever the header or the tags say, the decoder gives an RGB image or
a 4xx naming the image, never another exception (which the server answers with a 500)."""

from __future__ import annotations

import random
import struct

import pytest
from PIL import Image

from pipeline.errors import ImageDecodeError, PayloadTooLarge
from tests.images import encode, make_image
from vision.image_io import decode_image

FIELD = "messages[0].content[0].image_url.url"
FORMATS = {"PNG": {}, "JPEG": {"quality": 90}, "GIF": {}, "BMP": {}, "TIFF": {}, "WEBP": {"lossless": True}}
# values that sit at the edges of the integers headers hold: offsets, sizes and counts
EDGES = (0, 1, 0x7FFF_FFFF, 0xFFFF_FFFF)
TIFF_TYPES = range(14)  # every field type of TIFF 6.0, and 0 (none)


def outcome(data: bytes) -> str:
    """What the decoder made of ``data``: ``ok`` or the 4xx's class; any other exception fails the test."""
    try:
        image = decode_image(data, max_pixels=4_000_000, target_longest_edge=None, field=FIELD)
    except (ImageDecodeError, PayloadTooLarge) as exc:
        assert exc.field == FIELD and 400 <= exc.status < 500, exc
        return type(exc).__name__
    assert isinstance(image, Image.Image) and image.mode == "RGB"
    return "ok"


def mutations(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    """Truncations, bytes flipped in the first 200 (the header), and header words set to edge values."""
    out = []
    head = min(len(data), 200)
    for _ in range(count):
        mutated = bytearray(data)
        kind = rng.randrange(3)
        if kind == 0:
            mutated = mutated[: rng.randrange(1, len(mutated))]
        elif kind == 1:
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(head)] = rng.randrange(256)
        else:
            at = rng.randrange(max(1, head - 4))
            mutated[at : at + 4] = struct.pack("<I", rng.choice(EDGES))
        out.append(bytes(mutated))
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_mutated_headers_are_decoded_or_refused(fmt: str) -> None:
    data = encode(make_image(16, 12, seed=1), fmt, **FORMATS[fmt])
    seen = {outcome(mutated) for mutated in mutations(data, random.Random(f"fuzz-{fmt}"), 300)}
    assert "ImageDecodeError" in seen  # the corpus reaches the decoder's refusals


def _entries(tiff: bytes) -> list[int]:
    """Where each entry of a little-endian TIFF's first IFD starts."""
    first = struct.unpack_from("<I", tiff, 4)[0]
    count = struct.unpack_from("<H", tiff, first)[0]
    return [first + 2 + 12 * k for k in range(count)]


@pytest.mark.parametrize("compression", [None, "tiff_lzw", "packbits"])
def test_every_tiff_tag_of_every_type_is_decoded_or_refused(compression: str | None) -> None:
    # each tag of a real file given every field type, an edge value and count: the family of the
    # StripOffsets-as-FLOAT file, whose TypeError was a 500
    params = {"compression": compression} if compression else {}
    data = encode(make_image(6, 4, seed=2), "TIFF", **params)
    assert data[:2] == b"II"
    rng = random.Random(f"tiff-{compression}")
    seen: set[str] = set()
    for at in _entries(data):
        for field_type in TIFF_TYPES:
            mutated = bytearray(data)
            struct.pack_into("<HI", mutated, at + 2, field_type, rng.choice((1, 2, 0x7FFF_FFFF)))
            struct.pack_into("<I", mutated, at + 8, rng.choice(EDGES))
            seen.add(outcome(bytes(mutated)))
    assert "ImageDecodeError" in seen
