"""Image bytes → RGB ``PIL.Image``: format allow-list, pixel cap before decoding, JPEG draft mode,
EXIF orientation, first frame of animations, and every mode converted to RGB."""

from __future__ import annotations

import io

from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.errors import ImageDecodeError, PayloadTooLarge

__all__ = ["SUPPORTED_FORMATS", "check_scalable", "decode_image", "draft_size"]

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_WHITE = (255, 255, 255)
_BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)
_MAX_REASON = 200  # characters of Pillow's own message kept in ours
# Whatever Pillow raises while it opens, loads, turns or converts the bytes is the image's fault, a
# 400 naming it. Truncated or corrupt data surfaces as OSError, ValueError, SyntaxError, EOFError or
# struct.error depending on the plugin (and where warnings are errors, as its UserWarnings about
# damaged files); crafted headers reach plugin code that never expected them: a 190-byte TIFF whose
# StripOffsets tag is a float or UNDEFINED raised TypeError, and an offset past 2**63 OverflowError.
# MemoryError is not the bytes' fault (the pixel cap is checked before anything is decoded).


def decode_image(data: bytes, *, max_pixels: int, target_longest_edge: int | None, field: str) -> Image.Image:
    """Decode ``data`` into an RGB image; JPEG draft mode never shrinks it below ``target_longest_edge``.

    :raises ImageDecodeError: bytes that are not a supported, intact image.
    :raises PayloadTooLarge: more than ``max_pixels`` pixels (checked from the header, before decoding).
    """
    try:
        return _decode(data, max_pixels, target_longest_edge, field)
    except (ImageDecodeError, PayloadTooLarge, MemoryError):
        raise
    except _BOMB as exc:
        raise _bomb(exc, max_pixels, field) from None
    except Exception as exc:
        raise ImageDecodeError(f"corrupt or truncated image: {_reason(exc)}", field=field, stage="decode") from None


def _decode(data: bytes, max_pixels: int, target_longest_edge: int | None, field: str) -> Image.Image:
    image = _open(data, max_pixels, field)
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"image of {width}x{height} = {width * height} pixels; at most {max_pixels} are allowed",
            field=field,
            stage="decode",
        )
    image.seek(0)  # animations and multi-page TIFFs: first frame only
    if image.format == "JPEG" and target_longest_edge is not None:
        size = draft_size(image.size, target_longest_edge)
        if size is not None:
            # The model's processor resizes to target_longest_edge anyway, and libjpeg can decode at
            # 1/2, 1/4 or 1/8 scale inside the IDCT, never below the requested size: 1/16 of the pixels
            # at 1/4 (measured here: 4096x3072 in 27 ms at full size, 7 ms at 1/4), and the processor's
            # resize that follows is cheaper too.
            image.draft("RGB", size)
    image.load()
    ImageOps.exif_transpose(image, in_place=True)  # in place: no copy of an upright image
    return _to_rgb(image)


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if not isinstance(exc, OSError | ValueError | SyntaxError | EOFError):  # a kind the message does not say
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _bomb(exc: Exception, max_pixels: int, field: str) -> PayloadTooLarge:
    # Pillow's own check: it warns above Image.MAX_IMAGE_PIXELS (89M) and refuses above twice that.
    # Our cap is normally lower; the refusal, or the warning where warnings are errors, is the same 413.
    return PayloadTooLarge(
        f"image too large to decode ({exc}); at most {max_pixels} pixels are allowed", field=field, stage="decode"
    )


def check_scalable(size: tuple[int, int], longest_edge: int | None, field: str) -> None:
    """:raises ImageDecodeError: an image so thin that, scaled to the processor's longest edge, its
    shorter side would round to no pixel (the processor would fail on it)."""
    short, long = sorted(size)
    if longest_edge is not None and long > longest_edge and short * longest_edge < long:
        raise ImageDecodeError(
            f"the image is {size[0]}x{size[1]} pixels: scaled to the model's longest edge ({longest_edge} px) "
            f"its shorter side would be under one pixel (the aspect ratio may be at most {longest_edge}:1)",
            field=field,
            stage="decode",
        )


def draft_size(size: tuple[int, int], target_longest_edge: int) -> tuple[int, int] | None:
    """The size to ask ``Image.draft`` for, or None where DCT scaling would not help (less than 2x)."""
    width, height = size
    longest = max(width, height)
    if longest < 2 * target_longest_edge:
        return None
    # draft picks the largest scale 1/s with s <= longest // target, so the result stays >= the target
    return max(1, width * target_longest_edge // longest), max(1, height * target_longest_edge // longest)


def _open(data: bytes, max_pixels: int, field: str) -> Image.Image:
    if not data:
        raise ImageDecodeError("the image is empty (0 bytes)", field=field, stage="decode")
    try:
        # Image.open reads only the header (Pillow's own bomb check runs inside it: see _bomb)
        return Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except (*_BOMB, MemoryError):
        raise
    except UnidentifiedImageError:
        raise ImageDecodeError(
            f"not a supported image ({', '.join(SUPPORTED_FORMATS)})", field=field, stage="decode"
        ) from None
    except Exception as exc:
        raise ImageDecodeError(f"corrupt image header: {_reason(exc)}", field=field, stage="decode") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode.startswith("I"):  # I;16, I;16B, I;16L, I: 16-bit PNG/TIFF samples
        # convert("L") clips every value above 255 to white; scale 0..65535 into 0..255 instead
        image = image.convert("I").point(lambda v: v * (255 / 65535)).convert("L")
    elif image.mode == "F":
        image = image.convert("L")  # float samples have no standard range: clip to 0..255
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        # P/L/RGB with a transparent colour or index, and alpha modes: composite on white, since
        # convert("RGB") keeps whatever colour hides under alpha 0 (often black)
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, _WHITE)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if image.mode == "RGB":
        return image
    return image.convert("RGB")  # P, L, 1, CMYK, YCbCr, LAB, HSV
