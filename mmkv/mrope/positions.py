"""The M-RoPE position rule of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4.xV for text and still images.

Every token carries three position ids ``(t, h, w)``. A text token at position ``p`` gets ``(p, p, p)`` and
advances ``p`` by one. An image whose language-model grid is ``h' x w'`` (the vision grid divided by the spatial
merge size) and whose first pad token sits at ``s`` gives pad ``k = r * w' + c`` the ids ``(s, s + r, s + c)``,
and advances ``p`` by ``max(h', w')``: an image occupies ``max(h', w')`` position *slots*, not ``h' * w'``.
``<|vision_start|>`` and ``<|vision_end|>`` are ordinary text tokens.

Worked example, merge 2, two text tokens, a ``(1, 4, 6)`` image (LLM grid 2 x 3), one text token::

    token   T0 T1 | I0 I1 I2 I3 I4 I5 | T2
    t        0  1 |  2  2  2  2  2  2 |  5
    h        0  1 |  2  2  2  3  3  3 |  5
    w        0  1 |  2  3  4  2  3  4 |  5

The image occupies ``max(2, 3) = 3`` slots (2, 3, 4), so the next text token is at 5.

This matches ``get_rope_index`` of the transformers models (checked in ``tests/mrope/test_positions.py``).
All functions are pure and return new ``torch.long`` tensors on the CPU unless a device is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "ImageSpan",
    "PositionRule",
    "TextSpan",
    "image_positions",
    "image_slots",
    "llm_grid",
    "sequence_positions",
    "text_positions",
]


def _grid_tuple(grid_thw: Sequence[int] | torch.Tensor) -> tuple[int, int, int]:
    """A ``(t, h, w)`` vision grid as three Python ints."""
    values = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    if len(values) != 3:
        raise ValueError(f"an image grid is (t, h, w), got {values!r}")
    return int(values[0]), int(values[1]), int(values[2])


def llm_grid(grid_thw: Sequence[int] | torch.Tensor, merge_size: int = 2) -> tuple[int, int, int]:
    """The language-model grid ``(t, h', w')`` of a vision grid ``(t, h, w)``: ``h' = h // merge``.

    Raises ``ValueError`` for a video-like grid (``t != 1``) or a grid not divisible by ``merge_size``.
    """
    t, h, w = _grid_tuple(grid_thw)
    if t != 1:
        raise ValueError(f"only still images (grid t == 1) are supported, got grid {(t, h, w)}")
    if h % merge_size or w % merge_size or h <= 0 or w <= 0:
        raise ValueError(f"grid {(t, h, w)} is not a positive multiple of merge size {merge_size}")
    return 1, h // merge_size, w // merge_size


def text_positions(start: int, length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids ``(3, length)`` of a text span whose first token is at ``start``: ``(p, p, p)``."""
    if length < 0:
        raise ValueError(f"a span length cannot be negative, got {length}")
    row = torch.arange(start, start + length, dtype=torch.long, device=device)  # (L,)
    return row.unsqueeze(0).expand(3, -1).clone()  # (3, L)


def image_positions(
    start: int,
    grid_thw: Sequence[int] | torch.Tensor,
    merge_size: int = 2,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Position ids ``(3, h' * w')`` of an image's pad tokens, the first pad at ``start``.

    Example: ``image_positions(4, (1, 4, 6))`` gives ``T [4]*6 / H [4,4,4,5,5,5] / W [4,5,6,4,5,6]``.
    """
    _, h, w = llm_grid(grid_thw, merge_size)
    rows = torch.arange(h, dtype=torch.long, device=device).repeat_interleave(w)  # (h*w,)  r of k = r*w + c
    cols = torch.arange(w, dtype=torch.long, device=device).repeat(h)  # (h*w,)  c of k
    t = torch.zeros_like(rows)  # (h*w,)
    return torch.stack([t, rows, cols]) + start  # (3, h*w)


def image_slots(grid_thw: Sequence[int] | torch.Tensor, merge_size: int = 2) -> int:
    """How far an image advances the running position: ``max(h', w')`` (not ``h' * w'``)."""
    _, h, w = llm_grid(grid_thw, merge_size)
    return max(h, w)


@dataclass(frozen=True, slots=True)
class TextSpan:
    """A run of ``length`` text tokens (``length`` may be zero)."""

    length: int  # number of text tokens


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """The pad tokens of one image (its ``<|vision_start|>``/``<|vision_end|>`` belong to text spans)."""

    grid_thw: tuple[int, int, int]  # vision grid (1, h, w) as the image processor reports it


def sequence_positions(
    spans: Sequence[TextSpan | ImageSpan],
    start: int = 0,
    merge_size: int = 2,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, int]:
    """Position ids ``(3, total_len)`` of a whole layout, and the next free position after it.

    ``sequence_positions([TextSpan(2), ImageSpan((1, 4, 6)), TextSpan(1)])`` gives the worked example of the
    module docstring and ``6`` as the next position.
    """
    parts: list[torch.Tensor] = []
    position = start
    for span in spans:
        if isinstance(span, TextSpan):
            parts.append(text_positions(position, span.length, device))
            position += span.length
        elif isinstance(span, ImageSpan):
            parts.append(image_positions(position, span.grid_thw, merge_size, device))
            position += image_slots(span.grid_thw, merge_size)
        else:
            raise TypeError(f"expected TextSpan or ImageSpan, got {type(span).__name__}")
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long, device=device), position
    return torch.cat(parts, dim=1), position  # (3, total_len)


@dataclass(frozen=True, slots=True)
class PositionRule:
    """The position rule of one model: the pure functions above bound to its spatial merge size."""

    merge_size: int  # vision_config.spatial_merge_size (2 for every released Qwen-VL)

    def text(self, start: int, length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``(3, length)`` ids of a text span at ``start``."""
        return text_positions(start, length, device)

    def image(
        self, start: int, grid_thw: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``(3, h' * w')`` ids of an image's pads, first pad at ``start``."""
        return image_positions(start, grid_thw, self.merge_size, device)

    def image_slots(self, grid_thw: Sequence[int] | torch.Tensor) -> int:
        """Position slots an image occupies: ``max(h', w')``."""
        return image_slots(grid_thw, self.merge_size)

    def num_image_tokens(self, grid_thw: Sequence[int] | torch.Tensor) -> int:
        """Pad tokens an image expands to: ``h' * w'``."""
        _, h, w = llm_grid(grid_thw, self.merge_size)
        return h * w

    def sequence(
        self,
        spans: Sequence[TextSpan | ImageSpan],
        start: int = 0,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, int]:
        """``(3, total_len)`` ids of a layout and the next free position; see ``sequence_positions``."""
        return sequence_positions(spans, start, self.merge_size, device)
