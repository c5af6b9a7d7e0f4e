"""load_image: every input kind and mode to RGB, and each bad input to its error."""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

import mmkv
from mmkv.images import load_image


def _png_bytes(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


@pytest.fixture
def rgb() -> Image.Image:
    """A 24x16 RGB noise image."""
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8), "RGB")


def test_pil_path_and_bytes_give_identical_pixels(rgb, tmp_path):
    """The same picture as a PIL image, a PNG path and PNG bytes loads to identical RGB pixels."""
    path = tmp_path / "x.png"
    rgb.save(path)
    loaded = [load_image(rgb), load_image(path), load_image(str(path)), load_image(_png_bytes(rgb))]
    assert all(im.mode == "RGB" and im.tobytes() == rgb.tobytes() for im in loaded)


def test_modes_are_normalised_to_rgb():
    """RGBA over white, palette, grayscale, CMYK, 1-bit and 16-bit all become the expected RGB pixels."""
    transparent = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    half = Image.new("RGBA", (4, 4), (0, 0, 0, 128))
    assert load_image(transparent).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(half).getpixel((0, 0)) == (127, 127, 127)
    assert load_image(Image.new("L", (4, 4), 200)).getpixel((1, 1)) == (200, 200, 200)
    assert load_image(Image.new("RGB", (4, 4), (10, 20, 30)).quantize()).getpixel((0, 0)) == (10, 20, 30)
    assert load_image(Image.new("CMYK", (4, 4), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(Image.new("1", (4, 4), 1)).getpixel((0, 0)) == (255, 255, 255)
    sixteen = Image.fromarray(np.full((4, 4), 65535, dtype=np.uint16))
    assert load_image(sixteen).getpixel((0, 0)) == (255, 255, 255)
    mid = Image.fromarray(np.full((4, 4), 32896, dtype=np.uint16))  # 128.5 / 255 of full scale
    assert load_image(mid).getpixel((0, 0))[0] in (128, 129)


def test_exif_orientation_is_applied(rgb):
    """A JPEG tagged 'rotate 90' loads with its width and height swapped."""
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW to display
    data = _png_bytes(rgb, "JPEG", exif=exif.tobytes())
    assert load_image(data).size == (rgb.height, rgb.width)


def test_source_image_is_not_modified(rgb):
    """load_image returns a new image; the caller's image keeps its mode and pixels."""
    rgba = rgb.convert("RGBA")
    before = rgba.tobytes()
    load_image(rgba)
    assert rgba.mode == "RGBA" and rgba.tobytes() == before


@pytest.mark.parametrize(
    "data,error,match",
    [
        (b"", mmkv.UnreadableImageError, "empty"),
        (b"definitely not an image", mmkv.UnreadableImageError, "not a readable image"),
    ],
)
def test_garbage_bytes_raise_unreadable(data, error, match):
    """Empty and non-image bytes raise UnreadableImageError."""
    with pytest.raises(error, match=match):
        load_image(data)


def test_truncated_image_raises_unreadable(rgb):
    """A PNG cut in half raises UnreadableImageError (a ValueError), at load time."""
    data = _png_bytes(rgb.resize((240, 160)))
    with pytest.raises(mmkv.UnreadableImageError) as info:
        load_image(data[: len(data) // 2])
    assert isinstance(info.value, ValueError)


def test_decompression_bomb_is_refused_before_decoding():
    """A small file declaring 20000 x 20000 pixels raises ImageTooLargeError without being decoded."""
    data = _png_bytes(Image.new("1", (20000, 20000)), optimize=True)
    assert len(data) < 1_000_000
    with pytest.raises(mmkv.ImageTooLargeError, match="over the bound|exceeds"):
        load_image(data, max_pixels=10_000_000)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


HEADERS = {  # a few dozen bytes declaring width x height, in each format Pillow opens lazily
    "png": lambda w, h: (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
                         + _chunk(b"IDAT", zlib.compress(b"")) + _chunk(b"IEND", b"")),
    "gif": lambda w, h: (b"GIF89a" + struct.pack("<HHBBB", w, h, 0, 0, 0) + b"\x2c"
                         + struct.pack("<HHHHB", 0, 0, w, h, 0) + b"\x02\x02\x44\x01\x00\x3b"),
    "bmp": lambda w, h: (b"BM" + struct.pack("<IHHI", 54, 0, 0, 54)
                         + struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, 0, 2835, 2835, 0, 0)),
    "jpeg": lambda w, h: (b"\xff\xd8\xff\xc0" + struct.pack(">HBHHB", 17, 8, h, w, 3)
                          + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00\xff\xda" + struct.pack(">HB", 12, 3)
                          + b"\x01\x00\x02\x00\x03\x00\x00\x3f\x00\xff\xd9"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(HEADERS))
@pytest.mark.parametrize(
    "side, pixels",
    [(9000, "9000x9000 = 81,000,000"), (10000, "10000x10000 = 100,000,000"), (14000, "196,000,000"),
     (60000, "3,600,000,000")],
    ids=["between ours and Pillow's warning", "between Pillow's warning and its limit", "over Pillow's limit",
         "far over Pillow's limit"],
)  # fmt: skip
def test_every_image_over_the_bound_gets_our_error_and_words(fmt, side, pixels, tmp_path):
    """A header declaring side x side pixels, whichever of our bound (64 Mpx), Pillow's warning (89 Mpx) or
    Pillow's hard limit (179 Mpx) it passes, as bytes or as a file: ImageTooLargeError saying how many pixels
    and "over the bound" (what the server answers 413 on), never Pillow's decompression-bomb text, and no
    warning either."""
    data = HEADERS[fmt](side, side)
    assert len(data) < 200
    (tmp_path / "big").write_bytes(data)
    for source in (data, tmp_path / "big"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(mmkv.ImageTooLargeError) as info:
                load_image(source)
        message = str(info.value)
        assert (
            message
            == f"the image is {pixels} pixels, over the bound of 67,108,864; downscale it or raise max_pixels"
        )


def test_our_bound_decides_below_pillows_limit_and_a_raised_bound_says_which_held(monkeypatch, rgb):
    """With Pillow's limit lowered to 1000 px (hard limit 2000): a 40x24 image (960 px) and a 48x32 one (1536 px,
    past Pillow's warning) load under a 10,000 px bound without a warning; a 48x48 one (2304 px, past Pillow's
    hard limit) is ImageTooLargeError naming Pillow's bound of 2,000 and what to raise."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_image(_png_bytes(rgb.resize((40, 24))), max_pixels=10_000).size == (40, 24)
        assert load_image(_png_bytes(rgb.resize((48, 32))), max_pixels=10_000).size == (48, 32)
    with pytest.raises(
        mmkv.ImageTooLargeError, match="2,304 pixels, over the bound of 2,000 that Pillow opens"
    ):
        load_image(_png_bytes(rgb.resize((48, 48))), max_pixels=10_000)
    with pytest.raises(mmkv.ImageTooLargeError, match="2,304 pixels, over the bound of 1,500; downscale"):
        load_image(_png_bytes(rgb.resize((48, 48))), max_pixels=1500)


def test_zero_size_and_wrong_types_and_missing_files(tmp_path):
    """Zero-size images, unsupported types and missing paths raise their own errors."""
    with pytest.raises(mmkv.EmptyImageError):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(mmkv.UnsupportedInputError, match="got int"):
        load_image(42)
    with pytest.raises(mmkv.UnreadableImageError, match="no image file"):
        load_image(tmp_path / "missing.png")


def _with_declared_height(data: bytes, height: int) -> bytes:
    """A PNG's bytes with the IHDR height field replaced (its CRC fixed), the image data left as it was."""
    out = bytearray(data)
    out[20:24] = struct.pack(">I", height)
    out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])) & 0xFFFFFFFF)
    return bytes(out)


@pytest.mark.parametrize("interlace", [False, True])
@pytest.mark.parametrize("mode", ["RGB", "L", "P"])
def test_a_png_with_fewer_rows_than_its_header_declares_is_refused(rgb, tmp_path, mode, interlace):
    """Header rows > data rows (plain and Adam7-interlaced, several colour types): UnreadableImageError from
    bytes and from a path, where PIL itself would fill the missing rows with black."""
    data = _png_bytes(rgb.convert(mode), interlace=interlace) if interlace else _png_bytes(rgb.convert(mode))
    short = _with_declared_height(data, 40)
    assert Image.open(io.BytesIO(short)).size == (24, 40)
    with pytest.raises(mmkv.UnreadableImageError, match="truncated: its header declares 40 rows"):
        load_image(short)
    path = tmp_path / "short.png"
    path.write_bytes(short)
    with pytest.raises(mmkv.UnreadableImageError, match="truncated"):
        load_image(path)
    assert load_image(data).size == (24, 16)  # the intact file still loads


def test_float_images_use_pils_0_to_255_scale_and_distinct_images_stay_distinct(rgb):
    """A "F" image from PIL's own convert("F") loads as its "L" version would; two different float images give
    two different results (no longer both white); NaN and infinite pixels are refused."""
    gray = rgb.convert("L")
    as_float = gray.convert("F")
    assert np.array_equal(np.asarray(load_image(as_float)), np.asarray(load_image(gray)))
    other = Image.fromarray(255 - np.asarray(gray)).convert("F")
    assert not np.array_equal(np.asarray(load_image(as_float)), np.asarray(load_image(other)))
    for bad in (np.nan, np.inf, -np.inf):
        array = np.asarray(as_float).copy()
        array[3, 4] = bad
        with pytest.raises(mmkv.UnreadableImageError, match="NaN or infinite"):
            load_image(Image.fromarray(array, "F"))


@pytest.mark.parametrize("size", [(201, 1), (1, 201), (4020, 10)])
def test_an_aspect_ratio_over_200_is_refused_clearly(size):
    """Wider or taller than 200:1: ImageShapeError saying so (not transformers' raw ValueError)."""
    with pytest.raises(mmkv.ImageShapeError, match="aspect ratio over 200:1"):
        load_image(Image.new("RGB", size))
    assert load_image(Image.new("RGB", (200, 1))).size == (200, 1)


def test_the_first_frame_of_an_animated_image_is_used():
    """A GIF whose first frame is red and second blue loads as the red frame, from bytes and after seeking."""
    frames = [Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    opened = Image.open(io.BytesIO(buffer.getvalue()))
    opened.seek(1)
    for source in (buffer.getvalue(), opened):
        red, green, blue = np.asarray(load_image(source)).reshape(-1, 3).mean(0)
        assert red > 200 and blue < 50
    assert opened.tell() == 1  # the caller's image is left on its frame


@pytest.mark.parametrize("url", ["https://example.com/a.png", "http://10.0.0.1/x.jpg", "file:///etc/passwd"])
def test_a_url_is_not_fetched_and_says_so(url):
    """A URL string is refused with UnsupportedInputError saying the library does not fetch URLs."""
    with pytest.raises(mmkv.UnsupportedInputError, match="does not fetch URLs"):
        load_image(url)
