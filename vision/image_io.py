"""Image bytes → RGB ``PIL.Image``: format allow-list, pixel cap before decoding, JPEG draft mode,
EXIF orientation, first frame of animations, and every mode converted to RGB."""

from __future__ import annotations

import io

from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.errors import ImageDecodeError, PayloadTooLarge

__all__ = ["SUPPORTED_FORMATS", "decode_image"]

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_WHITE = (255, 255, 255)


def _open(data: bytes, field: str) -> Image.Image:
    if not data:
        raise ImageDecodeError("the image is empty", field=field, stage="decode")
    try:
        # Pillow warns above MAX_IMAGE_PIXELS and refuses above twice that; our own cap (checked
        # right after open, before any pixel is decoded) is lower, so its warning is only noise, and an
        # error (or a warning turned into one) is the same refusal
        return Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise PayloadTooLarge(f"image too large to decode: {exc}", field=field, stage="decode") from None
    except UnidentifiedImageError:
        raise ImageDecodeError(
            f"not a supported image ({', '.join(SUPPORTED_FORMATS)})", field=field, stage="decode"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageDecodeError(f"corrupt image: {exc}", field=field, stage="decode") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grey: scale into 8 bits instead of letting convert() clip everything to white
        scale = 1 / 256 if image.mode.startswith("I;16") else 1 / 65536
        image = image.point(lambda v: v * scale, "L") if image.mode != "I" else image.convert("L")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, _WHITE)
        background.paste(rgba, mask=rgba.getchannel("A"))  # transparent areas become white, not black
        return background
    return image.convert("RGB")


def decode_image(data: bytes, *, max_pixels: int, target_longest_edge: int | None, field: str) -> Image.Image:
    """Decode ``data`` into an RGB image.

    :raises ImageDecodeError: bytes that are not a supported, intact image.
    :raises PayloadTooLarge: more than ``max_pixels`` pixels (checked from the header, before decoding).
    """
    image = _open(data, field)
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"image of {width}x{height} = {width * height} pixels; at most {max_pixels} are allowed",
            field=field,
            stage="decode",
        )
    try:
        image.seek(0)  # animations: first frame only
        if image.format == "JPEG" and target_longest_edge and max(width, height) >= 2 * target_longest_edge:
            # the model resizes to target_longest_edge anyway; DCT scaling (1/2, 1/4, 1/8) decodes
            # several times faster and never goes below the requested size
            scale = target_longest_edge / max(width, height)
            image.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
        image.load()
        image = ImageOps.exif_transpose(image) or image
        return _to_rgb(image)
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt pixel data
        raise ImageDecodeError(f"corrupt image: {exc}", field=field, stage="decode") from None
