"""Cutting a rendered prompt into the pieces mmkv caches: text runs and marker-wrapped images.

A conversation is rendered by the model's own chat template and processor (``VLProcessor``), so token ids are
exactly what the model would see; ``split_prompt`` then cuts those ids into ``PromptPiece`` s. An image piece is
``<|vision_start|>`` + its pads + ``<|vision_end|>`` (the unit whose KV is cached); everything else is text.
``layout_positions`` gives each piece its M-RoPE positions, which equal the model's ``get_rope_index``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .kv.spans import image_span, text_span
from .model.handle import ModelHandle
from .text.fields import fill_template

__all__ = ["PromptPiece", "RenderedPrompt", "layout_positions", "render_prompt", "split_prompt"]

_MARK = re.compile("\ue000([0-9]+)\ue001")  # stands in for a text item while the template renders


@dataclass(frozen=True, eq=False)
class RenderedPrompt:
    """A conversation rendered to token ids, with where each text item and each field value landed."""

    token_ids: torch.Tensor  # (L,) long
    text: str  # the rendered text (image pads expanded)
    item_spans: dict[int, tuple[int, int]] | None  # text item "item_id" -> [begin, end) token span
    field_spans: dict[str, tuple[int, int]] | None  # field name -> [begin, end) token span of its value
    # (both None when not traced, or when the chat template rewrites message text so spans cannot be traced)


def render_prompt(
    processor, messages: list[dict], grids: torch.Tensor, add_generation_prompt: bool, trace: bool = True
) -> RenderedPrompt:
    """Render ``messages`` (text items ``{"type": "text", "text", ["item_id", "template", "fields"]}``, image
    items ``{"type": "image"}``) with ``processor``'s chat template, expand the image pads for ``grids`` and
    tokenise; the token spans of text items that carry an ``item_id`` and of their fields' values come along.

    Spans are found by rendering with a private-use marker in place of each text item and substituting the
    text afterwards; if that differs from a direct rendering (a template that rewrites text), spans are None.
    ``trace=False`` skips that second rendering (spans None): the ids alone, as cheap as a plain rendering.
    """
    marked, direct, items = [], [], []
    for message in messages:
        marked_content, direct_content = [], []
        for item in message["content"]:
            if item["type"] == "text":
                marked_content.append({"type": "text", "text": f"\ue000{len(items)}\ue001"})
                direct_content.append({"type": "text", "text": item["text"]})
                items.append(item)
            else:
                marked_content.append({"type": item["type"]})
                direct_content.append({"type": item["type"]})
        marked.append({"role": message["role"], "content": marked_content})
        direct.append({"role": message["role"], "content": direct_content})
    text = processor.expand_image_pads(processor.apply_chat_template(direct, add_generation_prompt), grids)
    if not trace:
        return RenderedPrompt(torch.tensor(processor.encode_text(text), dtype=torch.long), text, None, None)
    template = processor.expand_image_pads(
        processor.apply_chat_template(marked, add_generation_prompt), grids
    )
    parts, char_items, char_fields, cursor, length = [], {}, {}, 0, 0
    for match in _MARK.finditer(template):
        item = items[int(match.group(1))]
        literal = template[cursor : match.start()]
        parts.append(literal)
        length += len(literal)
        body = item["text"]
        if "item_id" in item:
            char_items[item["item_id"]] = (length, length + len(body))
            if item.get("fields"):
                _, spans = fill_template(item["template"], item["fields"])
                for name, (b, e) in spans.items():
                    char_fields[name] = (length + b, length + e)
        parts.append(body)
        length += len(body)
        cursor = match.end()
    parts.append(template[cursor:])
    traced = "".join(parts) == text
    encoded = processor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=traced)
    ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
    if not traced:
        return RenderedPrompt(ids, text, None, None)
    offsets = encoded["offset_mapping"]
    ends = [e for _, e in offsets]

    def tokens(span: tuple[int, int]) -> tuple[int, int]:  # the tokens overlapping a character span
        begin = bisect.bisect_right(ends, span[0])
        end = begin
        while end < len(offsets) and offsets[end][0] < span[1]:
            end += 1
        return begin, end

    return RenderedPrompt(
        ids,
        text,
        {key: tokens(span) for key, span in char_items.items()},
        {name: tokens(span) for name, span in char_fields.items()},
    )


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
