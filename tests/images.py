"""Images made in the tests, from seeded generators."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

from PIL import Image


def make_image(width: int = 64, height: int = 48, *, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(8):
        x, y = rng.randrange(width), rng.randrange(height)
        box = (x, y, min(width, x + width // 4 + 1), min(height, y + height // 4 + 1))
        image.paste(tuple(rng.randrange(256) for _ in range(3)), box)
    return image.convert(mode)


def encode(image: Image.Image, fmt: str = "PNG", **params: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **params)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_request(urls: list[str], text: str = "Describe.", **extra: object) -> dict[str, object]:
    content: list[dict[str, object]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": content}], **extra}


def make_noise_image(width: int, height: int, *, seed: int) -> Image.Image:
    """Seeded RGB noise: it compresses badly, so its encoded bytes are as large as the format allows."""
    return Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels with one row of data: what a pixel cap
    refuses from the header alone, built in microseconds (a real 20,000 x 20,000 one is 1.2 GB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = b"\0" + b"\0" * (width * 3)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(row * 4, 9)) + chunk(b"IEND", b"")
