"""Token ids and positions of the two span kinds a prompt is cut into: text runs and marker-wrapped images.

An image span is ``<|vision_start|>``, its ``h' * w'`` pads, ``<|vision_end|>``: the unit mmkv caches, so that
an image's KV includes its markers. Starting at ``s``, the start marker sits at ``s``, the pads at ``s + 1``
(see ``mmkv.mrope.positions``) and the end marker at ``s + 1 + max(h', w')``; the span occupies
``max(h', w') + 2`` slots.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..model.handle import ModelHandle
from ..mrope import PositionRule

__all__ = ["image_span", "text_span"]


def text_span(token_ids: Sequence[int] | torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (L,), positions (3, L))`` of a text run whose first token is at ``start``."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    positions = torch.arange(start, start + ids.shape[0], dtype=torch.long).expand(3, -1).clone()  # (3, L)
    return ids, positions


def image_span(
    handle: ModelHandle, grid_thw: Sequence[int] | torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (L,), positions (3, L))`` of ``<|vision_start|>`` + pads + ``<|vision_end|>`` at ``start`` (fresh
    tensors: the span's shape per grid is worked out once and shifted)."""
    proc = handle.processor
    grid = tuple(int(x) for x in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw))
    ids, positions = _relative_image_span(
        proc.vision_start_token_id,
        proc.image_token_id,
        proc.vision_end_token_id,
        handle.position_rule.merge_size,
        grid,
    )
    return ids.clone(), positions + start


@functools.lru_cache(maxsize=256)
def _relative_image_span(
    start_id: int, pad_id: int, end_id: int, merge_size: int, grid: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and positions of an image span starting at position 0 (cached per grid; never mutated)."""
    rule = PositionRule(merge_size)
    num_pads = rule.num_image_tokens(grid)
    ids = torch.tensor([start_id] + [pad_id] * num_pads + [end_id], dtype=torch.long)  # (num_pads + 2,)
    positions = torch.cat(
        [
            torch.zeros((3, 1), dtype=torch.long),
            rule.image(1, grid),  # (3, num_pads)
            torch.full((3, 1), 1 + rule.image_slots(grid), dtype=torch.long),
        ],
        dim=1,
    )  # (3, num_pads + 2)
    return ids, positions
