"""Synthetic screenshots for examples, benchmarks and the demo: no data set needed, deterministic per seed."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["synthetic_screenshot"]


def synthetic_screenshot(seed: int = 0, size: tuple[int, int] = (224, 160)) -> Image.Image:
    """An RGB 'screenshot' of ``size`` (width, height): a title bar and a few coloured buttons on a light
    background, laid out from ``seed``."""
    rng = np.random.default_rng(seed)
    width, height = size
    image = Image.new("RGB", size, (235, 235, 235))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, width, max(4, height // 12)], fill=tuple(int(v) for v in rng.integers(40, 120, 3)))
    for _ in range(6):
        w, h = max(4, width // 6), max(3, height // 8)
        x, y = (
            int(rng.integers(0, max(1, width - w))),
            int(rng.integers(height // 10, max(height // 10 + 1, height - h))),
        )
        draw.rectangle(
            [x, y, x + w, y + h], fill=tuple(int(v) for v in rng.integers(0, 255, 3)), outline=(0, 0, 0)
        )
    return image
