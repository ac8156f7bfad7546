from __future__ import annotations

import io
import struct
import time
import zlib

import pytest
from PIL import Image, ImageFile

from pipeline.errors import ImageDecodeError, PayloadTooLarge
from tests.images import TIFF_FLOAT, TIFF_LONG, TIFF_UNDEFINED, encode, make_image, tiff_with_strip_offsets
from vision.image_io import decode_image, draft_size

FIELD = "messages[0].content[1].image_url.url"
RED, GREEN, BLUE, WHITE = (250, 0, 0), (0, 250, 0), (0, 0, 250), (255, 255, 255)


def decode(data: bytes, target: int | None = None, *, max_pixels: int = 40_000_000) -> Image.Image:
    return decode_image(data, max_pixels=max_pixels, target_longest_edge=target, field=FIELD)


def close(pixel: object, expected: tuple[int, int, int], tolerance: int = 40) -> bool:
    assert isinstance(pixel, tuple)
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, expected, strict=True))


@pytest.mark.parametrize(
    ("fmt", "params"),
    [
        ("PNG", {}),
        ("BMP", {}),
        ("TIFF", {}),
        ("GIF", {}),  # make_image has few colours: the adaptive palette holds them exactly
        ("WEBP", {"lossless": True}),
    ],
)
def test_lossless_formats_round_trip_exactly(fmt: str, params: dict[str, object]) -> None:
    source = make_image(40, 30, seed=1)
    out = decode(encode(source, fmt, **params))
    assert out.mode == "RGB" and out.size == (40, 30)
    assert out.tobytes() == source.tobytes()


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_lossy_formats_decode_to_rgb(fmt: str) -> None:
    source = Image.new("RGB", (40, 30), BLUE)
    out = decode(encode(source, fmt, quality=95))
    assert out.mode == "RGB" and out.size == (40, 30) and close(out.getpixel((20, 15)), BLUE)


def test_alpha_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # transparent red: convert("RGB") would keep red
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    rgba.putpixel((1, 0), (0, 0, 0, 128))
    out = decode(encode(rgba, "PNG"))
    assert out.getpixel((3, 3)) == WHITE and out.getpixel((0, 0)) == (0, 0, 255)
    assert close(out.getpixel((1, 0)), (127, 127, 127), tolerance=2)  # half-transparent black: grey
    la = Image.new("LA", (2, 2), (0, 0))
    assert decode(encode(la, "PNG")).getpixel((1, 1)) == WHITE


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_transparency_is_composited_on_white(fmt: str) -> None:
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, 10, 200, 10] + [0] * 762)  # index 0: black, and transparent
    palette.putpixel((0, 0), 1)
    out = decode(encode(palette, fmt, transparency=0))
    assert out.getpixel((3, 3)) == WHITE and out.getpixel((0, 0)) == (10, 200, 10)


def test_transparent_colour_of_an_rgb_png_is_composited_on_white() -> None:
    image = Image.new("RGB", (4, 4), (1, 2, 3))
    image.putpixel((0, 0), (9, 9, 9))
    out = decode(encode(image, "PNG", transparency=(1, 2, 3)))
    assert out.getpixel((3, 3)) == WHITE and out.getpixel((0, 0)) == (9, 9, 9)


def test_grey_and_bilevel_become_rgb() -> None:
    assert decode(encode(Image.new("L", (3, 3), 128), "PNG")).getpixel((1, 1)) == (128, 128, 128)
    bilevel = Image.new("1", (3, 3), 0)
    bilevel.putpixel((0, 0), 1)
    out = decode(encode(bilevel, "PNG"))
    assert out.getpixel((0, 0)) == WHITE and out.getpixel((1, 1)) == (0, 0, 0)


@pytest.mark.parametrize(("mode", "fmt"), [("I;16", "PNG"), ("I;16", "TIFF"), ("I;16B", "TIFF")])
def test_16_bit_grey_is_scaled_into_8_bits_not_clipped(mode: str, fmt: str) -> None:
    deep = Image.new(mode, (4, 1))
    for x, value in enumerate((0, 257, 40_000, 65_535)):
        deep.putpixel((x, 0), value)
    out = decode(encode(deep, fmt))
    # convert("RGB") alone would give 255 for everything above 255
    assert [out.getpixel((x, 0)) for x in range(4)] == [(v, v, v) for v in (0, 1, 155, 255)]


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF"])
def test_cmyk_becomes_rgb(fmt: str) -> None:
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red
    out = decode(encode(cmyk, fmt, quality=95) if fmt == "JPEG" else encode(cmyk, fmt))
    assert out.mode == "RGB" and close(out.getpixel((4, 4)), (255, 0, 0))


def jpeg_with_marker(width: int, height: int, orientation: int) -> bytes:
    image = Image.new("RGB", (width, height), (0, 0, 0))
    image.paste(RED, (0, 0, width // 4, height // 2))  # marker in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", exif=exif, quality=95)


@pytest.mark.parametrize(
    ("orientation", "size", "marker"),
    [
        (1, (40, 20), (4, 4)),  # upright
        (3, (40, 20), (36, 16)),  # rotated 180: marker bottom-right
        (6, (20, 40), (15, 4)),  # rotate 90 clockwise to display: marker top-right
        (8, (20, 40), (4, 36)),  # rotate 90 counter-clockwise to display: marker bottom-left
    ],
)
def test_exif_orientation_is_applied(orientation: int, size: tuple[int, int], marker: tuple[int, int]) -> None:
    out = decode(jpeg_with_marker(40, 20, orientation))
    assert out.size == size
    assert close(out.getpixel(marker), RED)
    opposite = (size[0] - 1 - marker[0], size[1] - 1 - marker[1])
    assert close(out.getpixel(opposite), (0, 0, 0))


@pytest.mark.parametrize(("fmt", "params"), [("GIF", {}), ("WEBP", {"lossless": True})])
def test_animation_decodes_its_first_frame(fmt: str, params: dict[str, object]) -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in (RED, GREEN, BLUE)]
    buf = io.BytesIO()
    frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:], duration=50, **params)
    assert Image.open(io.BytesIO(buf.getvalue())).n_frames == 3  # type: ignore[attr-defined]
    assert close(decode(buf.getvalue()).getpixel((4, 4)), RED, tolerance=5)


def test_jpeg_draft_mode_when_the_model_shrinks_anyway() -> None:
    data = encode(make_image(4096, 3072, seed=5), "JPEG", quality=85)
    assert decode(data).size == (4096, 3072)
    drafted = decode(data, target=1024)
    assert drafted.mode == "RGB" and 1024 <= max(drafted.size) < 4096  # DCT scaling never goes below the target
    assert drafted.size == (1024, 768)
    assert decode(data, target=1500).size == (2048, 1536)  # 1/2 is the largest step that stays >= 1500


def test_draft_mode_only_where_it_pays() -> None:
    small = encode(make_image(1500, 1000, seed=6), "JPEG")
    assert decode(small, target=1024).size == (1500, 1000)  # less than 2x the target: full decode
    png = encode(make_image(2048, 1024, seed=7), "PNG")
    assert decode(png, target=256).size == (2048, 1024)  # only JPEG has DCT scaling
    assert draft_size((4096, 3072), 1024) == (1024, 768)
    assert draft_size((3072, 4096), 1000) == (750, 1000)
    assert draft_size((2047, 100), 1024) is None


def test_draft_mode_and_exif_orientation_together() -> None:
    out = decode(jpeg_with_marker(4096, 2048, orientation=6), target=1024)
    assert out.size == (512, 1024)  # decoded at 1/4, then rotated
    assert close(out.getpixel((500, 10)), RED) and close(out.getpixel((10, 1000)), (0, 0, 0))


PNG_BYTES = encode(make_image(64, 64, seed=2), "PNG")
JPEG_BYTES = encode(make_image(64, 64, seed=3), "JPEG")
TIFF_BYTES = encode(make_image(64, 64, seed=4), "TIFF")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"hello, I am a text file called cat.png", "not a supported image (jpeg, png"),
        (encode(make_image(8, 8), "PPM"), "not a supported image"),  # Pillow reads it: not on the list
        (encode(make_image(8, 8), "ICO"), "not a supported image"),
        (PNG_BYTES[:20], ""),  # inside the header
        (PNG_BYTES[:200], "truncated"),
        (PNG_BYTES[: len(PNG_BYTES) // 2], "truncated"),
        (JPEG_BYTES[:300], "truncated"),
        (JPEG_BYTES[: len(JPEG_BYTES) - 40], "truncated"),  # all but the end of the scan: no grey fill
        (TIFF_BYTES[: len(TIFF_BYTES) // 2], ""),
    ],
)
def test_bad_bytes_are_a_400_that_names_the_field(data: bytes, reason: str) -> None:
    with pytest.raises(ImageDecodeError) as info:
        decode(data)
    assert info.value.field == FIELD and info.value.stage == "decode" and info.value.status == 400
    assert reason in info.value.message.lower()


def huge_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height``; Image.open never reads past the header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("side", "max_pixels"),
    [
        (8_000, 40_000_000),  # our cap refuses it
        (20_000, 40_000_000),
        (10_000, 10**9),  # over Image.MAX_IMAGE_PIXELS: Pillow's warning (an error here) refuses it
        (20_000, 10**9),  # over twice that: Pillow's DecompressionBombError refuses it
    ],
)
def test_pixel_cap_is_checked_before_decoding(side: int, max_pixels: int) -> None:
    started = time.perf_counter()
    with pytest.raises(PayloadTooLarge) as info:
        decode(huge_png(side, side), max_pixels=max_pixels)
    assert time.perf_counter() - started < 0.5  # nothing was decoded (the pixels alone would be 1.2 GB)
    assert info.value.status == 413 and info.value.field == FIELD and info.value.stage == "decode"
    assert str(max_pixels) in info.value.message


def test_pixel_cap_boundary() -> None:
    data = encode(make_image(40, 30, seed=8), "PNG")
    assert decode(data, max_pixels=1200).size == (40, 30)
    with pytest.raises(PayloadTooLarge, match="40x30 = 1200 pixels; at most 1199"):
        decode(data, max_pixels=1199)


def test_a_hand_written_tiff_decodes() -> None:
    assert decode(tiff_with_strip_offsets(TIFF_LONG)).getpixel((1, 1)) == (255, 255, 255)


@pytest.mark.parametrize("field_type", [TIFF_UNDEFINED, TIFF_FLOAT])
def test_a_tiff_whose_strip_offsets_are_not_integers_is_a_400(field_type: int) -> None:
    # Pillow raised TypeError from inside its TIFF plugin: it left decode_image as itself, a 500
    with pytest.raises(ImageDecodeError) as info:
        decode(tiff_with_strip_offsets(field_type))
    assert info.value.status == 400 and info.value.field == FIELD and info.value.stage == "decode"
    assert "TypeError" in info.value.message


@pytest.mark.parametrize("kind", [TypeError, OverflowError, struct.error, RecursionError, KeyError])
def test_any_failure_inside_pillow_is_the_images_fault(monkeypatch: pytest.MonkeyPatch, kind: type) -> None:
    data = encode(make_image(8, 8), "PNG")

    def fail(self: ImageFile.ImageFile) -> None:
        raise kind("from inside a plugin")

    monkeypatch.setattr(ImageFile.ImageFile, "load", fail)
    with pytest.raises(ImageDecodeError) as info:
        decode(data)
    assert info.value.field == FIELD and kind.__name__ in info.value.message


def test_memory_error_is_not_called_the_images_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(make_image(8, 8), "PNG")

    def fail(self: ImageFile.ImageFile) -> None:
        raise MemoryError

    monkeypatch.setattr(ImageFile.ImageFile, "load", fail)
    with pytest.raises(MemoryError):
        decode(data)
