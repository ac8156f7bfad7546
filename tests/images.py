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


# TIFF field types (TIFF 6.0, section 2): what an IFD entry says its value is
TIFF_SHORT, TIFF_LONG, TIFF_RATIONAL, TIFF_UNDEFINED, TIFF_FLOAT = 3, 4, 5, 7, 11


def tiff_with_strip_offsets(field_type: int = TIFF_LONG) -> bytes:
    """A 2x2 grey TIFF written by hand (114 bytes), its ``StripOffsets`` tag (273) of ``field_type``:
    LONG is a valid file; UNDEFINED or FLOAT made Pillow raise TypeError while it decoded the strip."""
    pixels = b"\x00\x40\x80\xff"
    num_entries = 8
    data_offset = 8 + 2 + num_entries * 12 + 4  # header, entry count, entries, next-IFD offset
    value = struct.pack("<f", float(data_offset)) if field_type == TIFF_FLOAT else struct.pack("<I", data_offset)
    entries = [  # (tag, type, count, 4-byte value), in tag order
        (256, TIFF_SHORT, 1, struct.pack("<HH", 2, 0)),  # width
        (257, TIFF_SHORT, 1, struct.pack("<HH", 2, 0)),  # height
        (258, TIFF_SHORT, 1, struct.pack("<HH", 8, 0)),  # bits per sample
        (259, TIFF_SHORT, 1, struct.pack("<HH", 1, 0)),  # no compression
        (262, TIFF_SHORT, 1, struct.pack("<HH", 1, 0)),  # black is zero
        (273, field_type, 1, value),  # StripOffsets
        (278, TIFF_SHORT, 1, struct.pack("<HH", 2, 0)),  # rows per strip
        (279, TIFF_LONG, 1, struct.pack("<I", len(pixels))),  # strip byte counts
    ]
    ifd = struct.pack("<H", num_entries)
    ifd += b"".join(struct.pack("<HHI", tag, kind, count) + raw for tag, kind, count, raw in entries)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + pixels
