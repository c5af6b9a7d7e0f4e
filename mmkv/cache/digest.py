"""Content digests: the keys of the image and text stores.

``image_digest`` hashes what determines an image's KV: the decoded pixels (mode-normalised to RGB, with the
size), the processor settings that change its tokens (patch, merge, pixel bounds) and the model fingerprint.
Two encodings of the same pixels (PNG and lossless WebP, say) hit; a one-pixel change misses. SHA-256, full
width, never truncated (a truncated hash once served another image's KV in a peer system).
"""

from __future__ import annotations

import hashlib
from typing import NewType

from PIL import Image

__all__ = ["ImageDigest", "TextDigest", "image_digest", "text_digest"]

ImageDigest = NewType("ImageDigest", str)  # SHA-256 hex of pixels + processor settings + model fingerprint
TextDigest = NewType("TextDigest", str)  # SHA-256 hex of token ids + preamble + model fingerprint


def image_digest(image: Image.Image, processor, fingerprint: str) -> ImageDigest:
    """Digest of an RGB ``image`` as ``processor`` (a ``VLProcessor``) would encode it for one model.

    ``image`` must already be normalised (``mmkv.images.load_image``); its mode must be RGB.
    """
    if image.mode != "RGB":
        raise ValueError(f"normalise the image to RGB first (mmkv.images.load_image); got mode {image.mode}")
    min_pixels, max_pixels = processor.pixel_bounds
    h = hashlib.sha256(b"mmkv-image-v1\0")
    h.update(
        f"{image.width}x{image.height}|patch={processor.patch_size}|merge={processor.merge_size}|".encode()
    )
    h.update(f"pixels={min_pixels}..{max_pixels}|model={fingerprint}\0".encode())
    h.update(image.tobytes())
    return ImageDigest(h.hexdigest())


def text_digest(token_ids, fingerprint: str, context: str = "") -> TextDigest:
    """Digest of a token sequence for one model, with the name of the canonical context it was computed in."""
    h = hashlib.sha256(b"mmkv-text-v1\0")
    h.update(f"model={fingerprint}|context={context}\0".encode())
    h.update(",".join(str(int(t)) for t in token_ids).encode())
    return TextDigest(h.hexdigest())
