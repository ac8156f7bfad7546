from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from functools import partial

import anyio
import pytest
from PIL import Image

from pipeline.config import PipelineConfig
from pipeline.errors import ImageDecodeError, PayloadTooLarge
from stages.decode import DecodeStage
from tests.images import encode, make_image
from vision.image_io import decode_image

FIELD = "messages[0].content[1].image_url.url"


def decode(data: bytes, target: int | None = None) -> Image.Image:
    return decode_image(data, max_pixels=40_000_000, target_longest_edge=target, field=FIELD)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_every_supported_format_decodes_to_rgb(fmt: str) -> None:
    out = decode(encode(make_image(40, 30, seed=1), fmt))
    assert out.mode == "RGB" and out.size == (40, 30)


def test_transparency_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    out = decode(encode(rgba, "PNG"))
    assert out.getpixel((1, 1)) == (255, 255, 255) and out.getpixel((0, 0)) == (0, 0, 255)
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, 10, 200, 10] + [0] * 762)
    palette.putpixel((0, 0), 1)
    buf = io.BytesIO()
    palette.save(buf, format="PNG", transparency=0)
    out = decode(buf.getvalue())
    assert out.getpixel((3, 3)) == (255, 255, 255) and out.getpixel((0, 0)) == (10, 200, 10)


def test_grey_16_bit_and_cmyk_become_rgb() -> None:
    grey = Image.new("L", (3, 3), 128)
    assert decode(encode(grey, "PNG")).getpixel((1, 1)) == (128, 128, 128)
    deep = Image.new("I;16", (3, 3), 40000)
    value = decode(encode(deep, "PNG")).getpixel((1, 1))
    assert value[0] == value[1] == value[2] and 150 <= value[0] <= 160  # 40000/65535 of white, not clipped
    cmyk = Image.new("CMYK", (3, 3), (0, 255, 255, 0))  # red
    r, g, b = decode(encode(cmyk, "JPEG", quality=95)).getpixel((1, 1))
    assert r > 200 and g < 60 and b < 60


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 0, 0), (0, 0, 10, 10))  # marker in the top-left corner
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = decode(encode(image, "JPEG", exif=exif, quality=95))
    assert out.size == (20, 40)
    assert out.getpixel((15, 4))[0] > 200  # the marker moved to the top-right corner


def test_animated_gif_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((250, 0, 0), (0, 250, 0), (0, 0, 250))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    r, g, b = decode(buf.getvalue()).getpixel((4, 4))
    assert r > 200 and g < 50 and b < 50


def test_jpeg_draft_mode_when_the_model_shrinks_anyway() -> None:
    data = encode(make_image(4096, 3072, seed=5), "JPEG", quality=85)
    full = decode(data)
    drafted = decode(data, target=1024)
    assert full.size == (4096, 3072)
    assert 1024 <= max(drafted.size) < 4096  # DCT scaling never goes below the target


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", ImageDecodeError),
        (b"hello, I am a text file called cat.png", ImageDecodeError),
        (encode(make_image(64, 64, seed=2), "PNG")[:200], ImageDecodeError),
        (encode(make_image(64, 64, seed=3), "JPEG")[:300], ImageDecodeError),
        (b"\x00\x00\x01\x00" + b"\x00" * 40, ImageDecodeError),  # an ICO header: not on the allow-list
    ],
)
def test_bad_bytes_name_the_field(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        decode(data)
    assert info.value.field == FIELD and info.value.status == 400  # type: ignore[attr-defined]


def huge_png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [8_000, 20_000])
def test_pixel_cap_is_checked_before_decoding(side: int) -> None:
    started = time.perf_counter()
    with pytest.raises(PayloadTooLarge) as info:
        decode(huge_png(side, side))
    assert info.value.status == 413 and info.value.field == FIELD
    assert time.perf_counter() - started < 1.0  # nothing was decoded


async def test_decode_stage_holds_its_token_until_a_cancelled_thread_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = DecodeStage(PipelineConfig(decode_threads=1))
    entered, release = threading.Event(), threading.Event()

    def blocking(data: bytes, field: str) -> str:
        entered.set()
        release.wait(10)
        return "done"

    monkeypatch.setattr(stage, "_decode", blocking)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(stage.run, b"x", field=FIELD))
            await anyio.to_thread.run_sync(entered.wait)
            tg.cancel_scope.cancel()  # the caller goes away while the thread works
            assert stage.limiter.borrowed_tokens == 1
            release.set()
    assert stage.limiter.borrowed_tokens == 0 and stage.offload.calls == 1
