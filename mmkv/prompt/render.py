"""Rendering a conversation to token ids with the model's own chat template, tracing where each text landed.

A conversation is rendered by the model's own chat template and processor (``VLProcessor``), so token ids are
exactly what the model would see. ``render_prompt`` also returns the token span of every text item and every
field value (for edits and precompiled segments); ``mmkv.prompt.layout`` cuts the ids into pieces and gives
them positions.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..conversation import Message, TextItem
from ..fields import fill_template

__all__ = ["RenderedPrompt", "render_prompt"]

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
    processor,
    messages: Sequence[Message],
    grids: torch.Tensor,
    add_generation_prompt: bool,
    trace: bool = True,
) -> RenderedPrompt:
    """Render ``messages`` with ``processor``'s chat template, expand the image pads for ``grids`` (one row per
    image item, in order) and tokenise; with ``trace``, the token spans of every text item (by ``item_id``) and
    of its fields' values come along. Changes nothing.

    Spans are found by rendering with a private-use marker in place of each text item and substituting the
    text afterwards; if that differs from a direct rendering (a template that rewrites text), spans are None.
    ``trace=False`` skips that second rendering (spans None): the ids alone, as cheap as a plain rendering.
    """
    marked, direct, items = [], [], []
    for message in messages:
        marked_content, direct_content = [], []
        for item in message.items:
            if isinstance(item, TextItem):
                marked_content.append({"type": "text", "text": f"\ue000{len(items)}\ue001"})
                direct_content.append({"type": "text", "text": item.text})
                items.append(item)
            else:
                marked_content.append({"type": "image"})
                direct_content.append({"type": "image"})
        marked.append({"role": message.role, "content": marked_content})
        direct.append({"role": message.role, "content": direct_content})
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
        body = item.text
        char_items[item.item_id] = (length, length + len(body))
        if item.fields:
            _, spans = fill_template(item.template, item.field_map)
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
