"""Turning what users hand us (a PIL image, a path, bytes) into a plain RGB image, or a clear error.

``load_image`` checks the declared size against a pixel bound *before* decoding (a decompression bomb is
refused without allocating it), decodes fully (a truncated file fails here, not later), applies the EXIF
orientation, and normalises the mode: transparency is composited over white (as Qwen-VL's own tooling does),
palette, grayscale, CMYK and 1-bit images become RGB, 16-bit and 32-bit integer images are scaled to 8 bits.
The result is what ``image_digest`` hashes and what the processor sees.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from .errors import EmptyImageError, ImageTooLargeError, UnreadableImageError, UnsupportedInputError

__all__ = ["DEFAULT_MAX_PIXELS", "ImageSource", "load_image"]

DEFAULT_MAX_PIXELS = 64 * 1024 * 1024  # 64 megapixels: far above any screenshot, far below a bomb
ImageSource = Image.Image | str | os.PathLike | bytes | bytearray | memoryview


def _open(source: ImageSource) -> Image.Image:
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise UnreadableImageError("the image bytes are empty")
        stream = io.BytesIO(bytes(source))
        label = f"{len(source)} bytes"
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise UnreadableImageError(f"no image file at {str(path)!r}")
        stream, label = path.open("rb"), str(path)
    else:
        raise UnsupportedInputError(
            f"an image must be a PIL.Image.Image, a path or bytes; got {type(source).__name__}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(stream)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(f"{label}: {exc}") from exc
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ValueError...
        raise UnreadableImageError(f"{label} is not a readable image ({type(exc).__name__}: {exc})") from exc


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        array = np.asarray(image, dtype=np.float64)  # (H, W)
        top = 65535.0 if mode.startswith("I;16") or array.max() > 255 else 255.0
        image = Image.fromarray(np.clip(array / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    elif mode == "F":
        array = np.asarray(image, dtype=np.float64)
        image = Image.fromarray(np.clip(array * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info or image.mode in ("PA", "LA"):
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB")


def load_image(source: ImageSource, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """A new RGB ``PIL.Image`` from ``source``; ``source`` itself is never modified.

    Raises ``UnsupportedInputError`` (a ``TypeError``) for other input types, ``UnreadableImageError`` for
    undecodable or truncated data, ``ImageTooLargeError`` over ``max_pixels``, ``EmptyImageError`` for a zero
    width or height (all ``ValueError``).
    """
    image = _open(source)
    width, height = image.size
    if width == 0 or height == 0:
        raise EmptyImageError(f"the image is {width}x{height}; it has no pixels")
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"the image is {width}x{height} = {width * height:,} pixels, over the bound of {max_pixels:,}; "
            f"downscale it or raise max_pixels"
        )
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return _to_rgb(image)
    except (ImageTooLargeError, EmptyImageError):
        raise
    except Exception as exc:
        raise UnreadableImageError(f"the image could not be decoded ({type(exc).__name__}: {exc})") from exc
