"""Turning what users hand us (a PIL image, a path, bytes) into a plain RGB image, or a clear error.

``load_image`` checks the declared size against a pixel bound *before* decoding (a decompression bomb is
refused without allocating it; one over Pillow's own limit, ``PIL.Image.MAX_IMAGE_PIXELS``, gets the same
``ImageTooLargeError`` and message as one between our bound and Pillow's: Pillow's soft-limit warning is not
used, its hard limit, twice that, is reported in our words) and the aspect ratio against what Qwen-VL processors take (at most 200:1),
decodes fully (a truncated file fails here, not later: for PNG, also one whose data holds fewer rows than its
header declares), applies the EXIF orientation, and normalises the mode: transparency is composited over white
(as Qwen-VL's own tooling does), palette, grayscale, CMYK and 1-bit images become RGB, 16-bit and 32-bit integer
images are scaled to 8 bits, and 32-bit float (``"F"``) images are read as PIL reads them, 0-255 (PIL's own
``convert("F")`` and ``convert("L")`` use that scale; multiply 0-1 data by 255 first), with NaN or infinite
pixels refused. Of an animated image (GIF, APNG, WebP) the **first frame** is used. The result is what
``image_digest`` hashes and what the processor sees.

URLs are not fetched here (a string is a file path): the server fetches ``http(s)`` images only for hosts its
``--allowed-media-domains`` allows.
"""

from __future__ import annotations

import io
import os
import re
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from .errors import (
    EmptyImageError,
    ImageShapeError,
    ImageTooLargeError,
    UnreadableImageError,
    UnsupportedInputError,
)

__all__ = ["DEFAULT_MAX_PIXELS", "MAX_ASPECT_RATIO", "ImageSource", "load_image"]

DEFAULT_MAX_PIXELS = 64 * 1024 * 1024  # 64 megapixels: far above any screenshot, far below a bomb
MAX_ASPECT_RATIO = 200  # Qwen-VL's smart_resize refuses longer / shorter sides beyond this ratio
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
ImageSource = Image.Image | str | os.PathLike | bytes | bytearray | memoryview


def _too_large(size: tuple[int, int] | None, pixels: int | None, max_pixels: int) -> ImageTooLargeError:
    """The one ``ImageTooLargeError`` message, whichever check (ours or Pillow's hard limit) caught it."""
    hard = 2 * (Image.MAX_IMAGE_PIXELS or 0)  # Pillow refuses to open more than this
    if size is not None:
        what = f"{size[0]}x{size[1]} = {size[0] * size[1]:,} pixels"
    else:
        what = f"{pixels:,} pixels" if pixels is not None else f"over {hard:,} pixels"
    if size is None and max_pixels > hard:  # a bound raised past Pillow's: Pillow's is the one that held
        return ImageTooLargeError(
            f"the image is {what}, over the bound of {hard:,} that Pillow opens (2 x PIL.Image.MAX_IMAGE_PIXELS); "
            "raise PIL.Image.MAX_IMAGE_PIXELS along with max_pixels, or downscale it"
        )
    return ImageTooLargeError(
        f"the image is {what}, over the bound of {max_pixels:,}; downscale it or raise max_pixels"
    )


def _declared_pixels(exc: BaseException) -> int | None:
    """The pixel count a ``DecompressionBombError`` names ("Image size (N pixels) exceeds ..."), if it does."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    return int(found.group(1)) if found else None


def _open(source: ImageSource, max_pixels: int) -> Image.Image:
    """Pillow's lazy image of ``source`` (header read, nothing decoded). Raises the ``ImageError`` of a bad input."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise UnreadableImageError("the image bytes are empty")
        stream = io.BytesIO(bytes(source))
        label = f"{len(source)} bytes"
    elif isinstance(source, (str, os.PathLike)):
        if isinstance(source, str) and re.match(r"(?i)^[a-z][a-z0-9+.-]*://", source):
            raise UnsupportedInputError(
                f"{source[:80]!r} is a URL; the library does not fetch URLs (download the image and pass the "
                "file or its bytes; the server fetches http(s) images for hosts in --allowed-media-domains)"
            )
        path = Path(source)
        if not path.is_file():
            raise UnreadableImageError(f"no image file at {str(path)!r}")
        stream, label = path.open("rb"), str(path)
    else:
        raise UnsupportedInputError(
            f"an image must be a PIL.Image.Image, a path or bytes; got {type(source).__name__}"
        )
    try:
        with warnings.catch_warnings():  # our bound decides (from the header); Pillow's soft warning is noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(stream)
    except BaseException as exc:
        stream.close()
        if isinstance(exc, Image.DecompressionBombError):  # Pillow's hard limit, from the header: our words
            raise _too_large(None, _declared_pixels(exc), max_pixels) from None
        if isinstance(exc, Image.UnidentifiedImageError):
            raise UnreadableImageError(
                f"{label} is not a readable image (not a format Pillow decodes)"
            ) from exc
        if isinstance(exc, Exception):  # PIL raises OSError, SyntaxError, ValueError...
            raise UnreadableImageError(
                f"{label} is not a readable image ({type(exc).__name__}: {exc})"
            ) from exc
        raise


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        array = np.asarray(image, dtype=np.float64)  # (H, W)
        top = 65535.0 if mode.startswith("I;16") or array.max() > 255 else 255.0
        image = Image.fromarray(np.clip(array / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    elif mode == "F":
        array = np.asarray(image, dtype=np.float64)  # (H, W), PIL's 0-255 scale
        if not np.isfinite(array).all():
            raise UnreadableImageError("the float image has NaN or infinite pixels; replace them first")
        image = Image.fromarray(np.clip(array + 0.5, 0, 255).astype(np.uint8), "L")
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
    image = _open(source, max_pixels)
    try:
        return _decoded(image, source, max_pixels)
    finally:
        if image is not source:  # ours: its file (or buffer) is closed, whatever happened
            image.close()


def _decoded(image: Image.Image, source: ImageSource, max_pixels: int) -> Image.Image:
    """A new RGB image of the opened ``image`` after the bound, shape and row checks (``load_image``)."""
    width, height = image.size
    if width == 0 or height == 0:
        raise EmptyImageError(f"the image is {width}x{height}; it has no pixels")
    if width * height > max_pixels:
        raise _too_large((width, height), None, max_pixels)
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageShapeError(
            f"the image is {width}x{height}, an aspect ratio over {MAX_ASPECT_RATIO}:1, which Qwen-VL processors "
            "refuse; crop or pad it"
        )
    if getattr(image, "format", None) == "PNG":
        _check_png_rows(source, width, height)
    frame = image.tell() if getattr(image, "n_frames", 1) > 1 else 0  # a caller's image: put its frame back
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if frame:
                image.seek(0)  # the first frame of an animated image
            image.load()
        if image.size[0] * image.size[1] > max_pixels:  # a frame that grew the canvas while decoding
            raise _too_large(image.size, None, max_pixels)
        return _to_rgb(ImageOps.exif_transpose(image))
    except (ImageTooLargeError, EmptyImageError, UnreadableImageError):
        raise
    except Image.DecompressionBombError as exc:  # a later GIF / APNG frame over Pillow's hard limit
        raise _too_large(None, _declared_pixels(exc), max_pixels) from None
    except Exception as exc:
        raise UnreadableImageError(f"the image could not be decoded ({type(exc).__name__}: {exc})") from exc
    finally:
        if frame:
            image.seek(frame)


def _check_png_rows(source: ImageSource, width: int, height: int) -> None:
    """Raise ``UnreadableImageError`` when a PNG's image data decompresses to fewer bytes than its header's
    rows need (PIL fills the missing rows with black without a word). PIL images passed in are not checked."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        data = Path(source).read_bytes()
    else:
        return
    if not data.startswith(_PNG_SIGNATURE):
        return
    cursor, header, idat = len(_PNG_SIGNATURE), None, []
    while cursor + 8 <= len(data):
        (length,) = struct.unpack(">I", data[cursor : cursor + 4])
        kind = data[cursor + 4 : cursor + 8]
        body = data[cursor + 8 : cursor + 8 + length]
        if kind == b"IHDR" and len(body) == 13:
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        cursor += 12 + length
    if header is None or header[3] not in _PNG_CHANNELS:
        return
    _, _, depth, colour, _, _, interlace = header
    bits = _PNG_CHANNELS[colour] * depth

    def row_bytes(w: int) -> int:
        return 1 + (w * bits + 7) // 8  # one filter byte per row

    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    expected = 0
    for x0, y0, dx, dy in passes:
        w, h = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        expected += h * row_bytes(w) if w > 0 and h > 0 else 0
    try:
        got = len(zlib.decompressobj().decompress(b"".join(idat), expected + 1))
    except zlib.error as exc:
        raise UnreadableImageError(f"the PNG's image data is corrupt ({exc})") from exc
    if got < expected:
        rows = got * height // max(1, expected)
        raise UnreadableImageError(
            f"the PNG is truncated: its header declares {height} rows, its data holds about {rows}"
        )
