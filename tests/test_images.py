"""load_image: every input kind and mode to RGB, and each bad input to its error."""

from __future__ import annotations

import io

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


def test_zero_size_and_wrong_types_and_missing_files(tmp_path):
    """Zero-size images, unsupported types and missing paths raise their own errors."""
    with pytest.raises(mmkv.EmptyImageError):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(mmkv.UnsupportedInputError, match="got int"):
        load_image(42)
    with pytest.raises(mmkv.UnreadableImageError, match="no image file"):
        load_image(tmp_path / "missing.png")
