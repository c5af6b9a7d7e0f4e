"""Synthetic pictures for the task suite, the simulated desktop, examples and benchmarks: no data set needed,
deterministic per seed; and the rule that splits pictures between training and held-out use.

- ``synthetic_screenshot``: a generic 'screenshot' (title bar, coloured buttons) for benchmarks and examples;
- ``render_panel``: the suite's UI panel (status badge, form field, three buttons), also the ticket screen of
  ``mmkv.envs``; 256 x 256 px by default, so 64 language-model tokens for both families (Qwen3-VL: one token
  per 32 x 32 px; Qwen2.5-VL: per 28 x 28 px after the small checkpoints' resize to 224 x 224);
- ``picture_digest`` / ``picture_split`` / ``draw_in_split``: a picture belongs to ``"train"`` or ``"heldout"``
  by a hash of its pixels (about one in five held out), and generators redraw a picture's free details (layout
  jitter, tints) until it falls in the split they serve. So no held-out picture can appear in any training
  sample or episode, whatever the seeds: the split is by picture content, not by sample.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NewType

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "COLOURS",
    "FIELD_FILL",
    "PANEL_SIZE",
    "PanelStyle",
    "PictureDigest",
    "Split",
    "draw_in_split",
    "picture_digest",
    "picture_split",
    "render_panel",
    "synthetic_screenshot",
]

Split = Literal["train", "heldout"]
PictureDigest = NewType("PictureDigest", str)  # full-width SHA-256 hex of a picture's mode, size and pixels

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
FIELD_FILL = (40, 40, 40)  # a filled form field is dark; an empty one white
PANEL_SIZE = 256  # panel side in pixels: 8 x 8 language-model tokens in both families (see the docstring)
HELDOUT_ONE_IN = 5  # a picture is held out when its digest's first 32 bits are divisible by this
MAX_REDRAWS = 10_000  # draw_in_split gives up (a generator without free details) after this many tries


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


# ------------------------------------------------------------------------------------------------- splits
def picture_digest(image: Image.Image) -> PictureDigest:
    """SHA-256 of ``image``'s mode, size and raw pixels: equal exactly for equal pictures. Pure."""
    h = hashlib.sha256(b"mmkv-picture-v1\0")
    h.update(f"{image.mode}\0{image.width}x{image.height}\0".encode())
    h.update(image.tobytes())
    return PictureDigest(h.hexdigest())


def picture_split(digest: PictureDigest) -> Split:
    """The split a picture belongs to, from its digest alone (about 1 in ``HELDOUT_ONE_IN`` held out).

    >>> picture_split(PictureDigest("0" * 64)), picture_split(PictureDigest("00000001" + "0" * 56))
    ('heldout', 'train')
    """
    return "heldout" if int(digest[:8], 16) % HELDOUT_ONE_IN == 0 else "train"


def draw_in_split(
    render: Callable[[random.Random], Image.Image], rng: random.Random, split: Split
) -> Image.Image:
    """``render(rng)`` called until its picture falls in ``split``; deterministic for a given ``rng`` state.

    ``render`` must draw its free details (jitter, tints) from the ``rng`` it is given, so that redraws differ.
    Raises ``RuntimeError`` after ``MAX_REDRAWS`` tries (a picture with no free details)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    for _ in range(MAX_REDRAWS):
        image = render(rng)
        if picture_split(picture_digest(image)) == split:
            return image
    raise RuntimeError(
        f"no picture in split {split!r} after {MAX_REDRAWS} draws: the renderer varies nothing"
    )


# ------------------------------------------------------------------------------------------------- panels
@dataclass(frozen=True, slots=True)
class PanelStyle:
    """The free details of a panel: everything but its state (drawn per picture, see ``draw_in_split``)."""

    dx: int  # layout offset to the right, px
    dy: int  # layout offset downwards, px
    title: tuple[int, int, int]  # title-bar colour
    background: tuple[int, int, int]  # panel background
    highlight: int  # which button (0-2) has the orange outline (a distractor)

    @classmethod
    def draw(cls, rng: random.Random, size: int = PANEL_SIZE) -> PanelStyle:
        """A random style for a panel of side ``size``."""
        jitter = size // 20
        shade = rng.randint(244, 252)
        return cls(
            rng.randint(0, jitter),
            rng.randint(0, jitter),
            tuple(rng.randint(40, 110) for _ in range(3)),
            (shade, shade, min(255, shade + rng.randint(0, 3))),
            rng.randint(0, 2),
        )


def render_panel(
    badge: str, field_filled: bool, style: PanelStyle | random.Random, size: int = PANEL_SIZE
) -> Image.Image:
    """A ``size`` x ``size`` UI panel: a title bar, a status badge top right (red when ``badge == "alert"``, else
    green), a form field (``FIELD_FILL`` when filled, else white) and three buttons, placed by ``style`` (a
    ``PanelStyle``, or a ``random.Random`` to draw one from). Returns an RGB image; changes nothing else.

    Layout at 256 px (offsets ``dx, dy`` added): title bar 0-28, badge 44-92 high near the right edge, field
    112-148, buttons 180-224 (each 60 px wide, 76 px apart)."""
    if isinstance(style, random.Random):
        style = PanelStyle.draw(style, size)
    unit = size / 128  # the layout is drawn on a 128-unit grid
    dx, dy = style.dx, style.dy

    def box(x0: float, y0: float, x1: float, y1: float) -> list[int]:
        return [round(x0 * unit) + dx, round(y0 * unit) + dy, round(x1 * unit) + dx, round(y1 * unit) + dy]

    image = Image.new("RGB", (size, size), style.background)
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, size, round(14 * unit) + dy // 2], fill=style.title)
    badge_colour = COLOURS["red"] if badge == "alert" else COLOURS["green"]
    draw.ellipse(box(94, 22, 118, 46), fill=badge_colour)
    draw.rectangle(
        box(6, 56, 114, 74), outline=(0, 0, 0), fill=FIELD_FILL if field_filled else (255, 255, 255)
    )
    for i in range(3):
        outline = (230, 120, 0) if i == style.highlight else (90, 90, 90)
        draw.rectangle(box(6 + 38 * i, 90, 36 + 38 * i, 112), fill=(120, 160, 220), outline=outline, width=3)
    return image
