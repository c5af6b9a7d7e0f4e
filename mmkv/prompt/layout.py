"""Cutting a rendered prompt into the pieces mmkv caches, and laying them out in M-RoPE position space.

``split_prompt`` cuts token ids into ``PromptPiece`` s: an image piece is ``<|vision_start|>`` + its pads +
``<|vision_end|>`` (the unit whose KV is cached); everything else is text. ``layout_positions`` gives each
piece its M-RoPE positions, which equal the model's ``get_rope_index``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..kv.spans import image_span, text_span
from ..model.handle import ModelHandle

__all__ = ["PromptPiece", "layout_positions", "split_prompt"]


@dataclass(frozen=True, eq=False)
class PromptPiece:
    """One piece of a prompt."""

    kind: Literal["text", "image"]  # a text run, or one marker-wrapped image
    token_ids: torch.Tensor  # (L,) long
    image_index: int | None  # which image of the prompt (0-based), for image pieces
    grid_thw: tuple[int, int, int] | None  # the image's vision grid, for image pieces

    @property
    def length(self) -> int:
        """Tokens in the piece."""
        return int(self.token_ids.shape[0])


def split_prompt(
    handle: ModelHandle, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
) -> list[PromptPiece]:
    """Cut ``input_ids`` (``(L,)`` or ``(1, L)``) into text and image pieces, in order; concatenating the pieces'
    ids gives ``input_ids`` back. Raises ``ValueError`` when the pads do not match ``image_grid_thw``."""
    ids = input_ids.reshape(-1).long()
    proc = handle.processor
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw]
    starts = (ids == proc.vision_start_token_id).nonzero().flatten().tolist()
    pieces: list[PromptPiece] = []
    cursor, image_index = 0, 0
    for start in starts:
        if start + 1 >= len(ids) or int(ids[start + 1]) != proc.image_token_id:
            continue  # a vision start not followed by image pads (a video, or literal text): leave it as text
        if image_index >= len(grids):
            raise ValueError(f"the prompt has more images than the {len(grids)} grids given")
        grid = grids[image_index]
        num_pads = handle.position_rule.num_image_tokens(grid)
        end = start + 1 + num_pads  # index of <|vision_end|>
        pads_ok = bool((ids[start + 1 : end] == proc.image_token_id).all())
        if end >= len(ids) or not pads_ok or int(ids[end]) != proc.vision_end_token_id:
            raise ValueError(
                f"image {image_index}: expected {num_pads} pads between the vision markers (grid {grid})"
            )
        if start > cursor:
            pieces.append(PromptPiece("text", ids[cursor:start], None, None))
        pieces.append(PromptPiece("image", ids[start : end + 1], image_index, grid))
        cursor, image_index = end + 1, image_index + 1
    if image_index != len(grids):
        raise ValueError(f"the prompt has {image_index} images but {len(grids)} grids were given")
    if cursor < len(ids):
        pieces.append(PromptPiece("text", ids[cursor:], None, None))
    return pieces


def layout_positions(
    handle: ModelHandle, pieces: Sequence[PromptPiece], start: int = 0
) -> list[torch.Tensor]:
    """The ``(3, L)`` position ids of each piece when laid out back to back from ``start``."""
    positions, position = [], start
    for piece in pieces:
        if piece.kind == "image":
            _, pos = image_span(handle, piece.grid_thw, position)
            position += handle.position_rule.image_slots(piece.grid_thw) + 2
        else:
            _, pos = text_span(piece.token_ids, position)
            position += piece.length
        positions.append(pos)
    return positions
