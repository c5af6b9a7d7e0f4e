"""image_digest / text_digest: same pixels hit, any change that alters the tokens misses, full width."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from mmkv.cache.digest import image_digest, text_digest
from mmkv.images import load_image


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture
def picture() -> Image.Image:
    """A 40x30 RGB noise image."""
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8), "RGB")


def test_same_pixels_in_other_encodings_hit(tiny, picture):
    """PNG, BMP and TIFF files of the same pixels give one digest, 64 hex characters (SHA-256, untruncated)."""
    digests = {
        image_digest(load_image(_encoded(picture, fmt)), tiny.processor, tiny.fingerprint)
        for fmt in ("PNG", "BMP", "TIFF")
    }
    assert len(digests) == 1 and len(next(iter(digests))) == 64


def test_one_pixel_change_misses(tiny, picture):
    """Changing one channel of one pixel by one changes the digest."""
    changed = picture.copy()
    r, g, b = changed.getpixel((7, 5))
    changed.putpixel((7, 5), ((r + 1) % 256, g, b))
    assert image_digest(picture, tiny.processor, tiny.fingerprint) != image_digest(
        changed, tiny.processor, tiny.fingerprint
    )


def test_model_and_processor_settings_are_part_of_the_key(tiny_by_name, picture):
    """Another model fingerprint or another pixel bound gives another digest."""
    q25, q3 = tiny_by_name["tiny-qwen2.5-vl"], tiny_by_name["tiny-qwen3-vl"]
    assert image_digest(picture, q25.processor, q25.fingerprint) != image_digest(
        picture, q25.processor, q3.fingerprint
    )
    original = dict(q25.processor.image_processor.size)
    try:
        q25.processor.image_processor.size = {**original, "longest_edge": original["longest_edge"] * 4}
        wider = image_digest(picture, q25.processor, q25.fingerprint)
    finally:
        q25.processor.image_processor.size = original
    assert wider != image_digest(picture, q25.processor, q25.fingerprint)


def test_non_rgb_input_is_refused(tiny, picture):
    """A non-normalised image raises ValueError pointing at load_image."""
    with pytest.raises(ValueError, match="load_image"):
        image_digest(picture.convert("RGBA"), tiny.processor, tiny.fingerprint)


def test_text_digest_depends_on_tokens_model_and_context():
    """Token ids, model fingerprint and context name each change the text digest."""
    base = text_digest([1, 2, 3], "m", "preamble")
    assert base != text_digest([1, 2, 4], "m", "preamble")
    assert base != text_digest([1, 2, 3], "n", "preamble")
    assert base != text_digest([1, 2, 3], "m", "other")
    assert base == text_digest([1, 2, 3], "m", "preamble") and len(base) == 64
