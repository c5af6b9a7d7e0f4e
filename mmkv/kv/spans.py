"""Token ids and positions of the two span kinds a prompt is cut into: text runs and marker-wrapped images.

An image span is ``<|vision_start|>``, its ``h' * w'`` pads, ``<|vision_end|>``: the unit mmkv caches, so that
an image's KV includes its markers. Starting at ``s``, the start marker sits at ``s``, the pads at ``s + 1``
(see ``mmkv.mrope.positions``) and the end marker at ``s + 1 + max(h', w')``; the span occupies
``max(h', w') + 2`` slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.handle import ModelHandle

__all__ = ["image_span", "text_span"]


def text_span(token_ids: Sequence[int] | torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (L,), positions (3, L))`` of a text run whose first token is at ``start``."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    positions = torch.arange(start, start + ids.shape[0], dtype=torch.long).expand(3, -1).clone()  # (3, L)
    return ids, positions


def image_span(
    handle: ModelHandle, grid_thw: Sequence[int] | torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (L,), positions (3, L))`` of ``<|vision_start|>`` + pads + ``<|vision_end|>`` at ``start``."""
    proc, rule = handle.processor, handle.position_rule
    num_pads = rule.num_image_tokens(grid_thw)
    ids = torch.tensor(
        [proc.vision_start_token_id] + [proc.image_token_id] * num_pads + [proc.vision_end_token_id],
        dtype=torch.long,
    )  # (num_pads + 2,)
    end_marker = start + 1 + rule.image_slots(grid_thw)
    positions = torch.cat(
        [
            torch.full((3, 1), start, dtype=torch.long),
            rule.image(start + 1, grid_thw),  # (3, num_pads)
            torch.full((3, 1), end_marker, dtype=torch.long),
        ],
        dim=1,
    )  # (3, num_pads + 2)
    return ids, positions
