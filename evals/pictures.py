"""The task suite's pictures: scenes of coloured shapes and UI panels, each drawn inside the split it serves.

A scene is a ``CANVAS`` x ``CANVAS`` picture (256 px: 64 language-model tokens in both small checkpoints) with
up to four objects in the cells of a 3 x 3 grid; each object is jittered inside its cell and the background is
tinted, so that the same objects give many distinct pictures. Panels come from ``mmkv.synthetic.render_panel``
(shared with the simulated desktop, ``mmkv.envs``). ``scene_in_split`` / ``panel_in_split`` redraw those free
details until the picture's pixel hash falls in the requested split (``mmkv.synthetic.draw_in_split``): a
held-out sample only ever shows held-out pictures.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from mmkv.synthetic import COLOURS, PANEL_SIZE, Split, draw_in_split, render_panel

__all__ = [
    "CANVAS",
    "GRID",
    "SHAPES",
    "SceneObject",
    "panel_in_split",
    "random_objects",
    "render_scene",
    "scene_in_split",
]

SHAPES = ("circle", "square", "triangle")
CANVAS = PANEL_SIZE  # scene side in pixels (256: 8 x 8 language-model tokens)
GRID = 3  # objects sit in the cells of a GRID x GRID layout
INSET = 14  # an object's margin inside its cell, px (before jitter)
JITTER = 8  # an object moves up to this many px either way inside its cell


@dataclass(frozen=True, slots=True)
class SceneObject:
    """One object of a scene."""

    shape: str  # one of SHAPES
    colour: str  # a key of COLOURS
    row: int  # grid row, 0 at the top
    col: int  # grid column, 0 at the left


_Object = SceneObject  # the name app/trajectory.py imports


def render_scene(
    objects: list[SceneObject],
    background: tuple[int, int, int] = (245, 245, 245),
    rng: random.Random | None = None,
) -> Image.Image:
    """A ``CANVAS`` x ``CANVAS`` RGB scene with each object drawn in its grid cell, in its exact colour.

    With ``rng``, each object is shifted up to ``JITTER`` px and resized a little inside its cell and the
    background is tinted (draws from ``rng``); without, objects are centred on ``background``."""
    if rng is not None:
        shade = rng.randint(236, 250)
        background = (shade, shade + rng.randint(0, 4), shade + rng.randint(0, 4))
    image = Image.new("RGB", (CANVAS, CANVAS), background)
    draw = ImageDraw.Draw(image)
    cell = CANVAS // GRID
    for obj in objects:
        ox, oy, grow = (
            (rng.randint(-JITTER, JITTER), rng.randint(-JITTER, JITTER), rng.randint(-6, 4))
            if rng
            else (0, 0, 0)
        )
        x0, y0 = obj.col * cell + INSET - grow + ox, obj.row * cell + INSET - grow + oy
        x1, y1 = (obj.col + 1) * cell - INSET + grow + ox, (obj.row + 1) * cell - INSET + grow + oy
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        elif obj.shape == "square":
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def random_objects(rng: random.Random, count: int, distinct: bool = True) -> list[SceneObject]:
    """``count`` objects in distinct cells; with ``distinct``, no two share both shape and colour."""
    cells = rng.sample([(r, c) for r in range(GRID) for c in range(GRID)], count)
    kinds = [(s, c) for s in SHAPES for c in COLOURS]
    chosen = rng.sample(kinds, count) if distinct else [rng.choice(kinds) for _ in range(count)]
    return [
        SceneObject(shape, colour, row, col)
        for (shape, colour), (row, col) in zip(chosen, cells, strict=True)
    ]


def scene_in_split(objects: list[SceneObject], rng: random.Random, split: Split) -> Image.Image:
    """A jittered scene of ``objects`` whose pixel hash lies in ``split``."""
    return draw_in_split(lambda r: render_scene(objects, rng=r), rng, split)


def panel_in_split(badge: str, field_filled: bool, rng: random.Random, split: Split) -> Image.Image:
    """A panel (``render_panel``) of this state whose pixel hash lies in ``split``."""
    return draw_in_split(lambda r: render_panel(badge, field_filled, r), rng, split)
