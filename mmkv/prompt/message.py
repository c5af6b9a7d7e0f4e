"""One message's block: its share of a prompt, rendered, tokenised (text only ever as text) and laid out from
position 0, so that ``mmkv.prompt.blocks`` can assemble a turn's layout from the blocks of its messages.

A block depends on the message's content alone (its role, its texts, the grids of its shown images, whether it
is the prompt's first message), never on the conversation it came from: images are numbered within the message
and text items by their order in it, so one block serves every conversation that holds the same message (the
server's requests, each a new conversation, resending the same history)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.spans import image_span, text_span
from ..messages import Message, TextItem
from ..model.handle import ModelHandle
from .chunks import Templates
from .render import _control_pattern, collect_spans, encode_parts, split_marked
from .views import render_views, tool_views

__all__ = ["Block", "NotIncremental", "generation_block", "message_block"]


@dataclass(frozen=True, eq=False)
class Block:
    """One message's share of a prompt, laid out from position 0."""

    token_ids: torch.Tensor  # (n,) long
    positions: torch.Tensor  # (3, n) long, relative to the block's first position
    num_slots: int  # position slots it occupies (the next block starts this much later)
    pieces: tuple[tuple, ...]  # (kind, begin relative, length, grid, k: its k-th shown image) per piece
    num_images: int  # images it shows
    item_spans: dict[int, tuple[int, int]]  # k -> token span of its k-th text item, relative
    field_spans: dict[str, tuple[int, int]]  # field -> token span of its value, relative
    segments: tuple[tuple[int, int], ...]  # (begin relative, k) of each precompiled segment held exactly by
    # its k-th text item


class NotIncremental(Exception):
    """This turn cannot be assembled from blocks (a chunk that does not start with a control token, or a
    template that rewrites text): render it whole."""


def generation_block(handle: ModelHandle, suffix: str) -> Block:
    """The block of the generation prompt (``suffix``, e.g. ``<|im_start|>assistant``)."""
    _check_starts_with_control(handle, suffix)
    ids, _ = encode_parts(handle.processor, [(suffix, True)])
    return _layout_block(handle, ids, (), ({}, {}), ())


def _check_starts_with_control(handle: ModelHandle, text: str) -> None:
    if text and not _control_pattern(handle.processor).match(text):
        raise NotIncremental


def message_block(
    handle: ModelHandle, templates: Templates, verbatim: bool, message: Message, first: bool, grids,
    tools_json: str = "",
) -> Block:  # fmt: skip
    """The block of ``message`` (the first of its prompt, declaring ``tools_json``, or a later one; ``grids``:
    the vision grid of each of its image items, in order): its chunk from the template (per structure when
    ``verbatim``, else checked against a rendering with its texts; a first message declaring tools is always
    checked), tokenised with caller text as text and pads inserted. Raises ``NotIncremental`` where the template
    cannot be taken apart this way."""
    views, direct_views, items = render_views(message)
    direct_tools = None
    if first and tools_json:
        _, direct_tools, tool_items = tool_views(tools_json, start=len(items))
        items = items + tool_items
    chunk = templates.structure_chunk(message, first, tools_json if first else "")
    checked = not verbatim or direct_tools is not None
    direct_chunk = templates.chunk(direct_views, first, direct_tools) if checked else None
    if chunk is None or (direct_chunk is None and checked):
        raise NotIncremental
    _check_starts_with_control(handle, chunk)
    parts, tags = split_marked(chunk, items)
    if checked and "".join(text for text, _ in parts) != direct_chunk:
        raise NotIncremental  # the template rewrites this message's text
    counts = [handle.position_rule.num_image_tokens(grid) for grid in grids]
    ids, spans = encode_parts(handle.processor, parts, offsets=True, pad_counts=counts)
    by_id, field_spans = collect_spans(tags, spans)
    texts = [i for i in message.items if isinstance(i, TextItem)]
    ordinal = {item.item_id: k for k, item in enumerate(texts)}
    item_spans = {ordinal[item_id]: span for item_id, span in by_id.items() if item_id in ordinal}
    anchors = []
    for k, item in enumerate(texts):
        if item.segment is not None and k in item_spans:
            begin, end = item_spans[k]
            if torch.equal(ids[begin:end], item.segment.token_ids):
                anchors.append((begin, k))
    return _layout_block(handle, ids, tuple(grids), (item_spans, field_spans), tuple(anchors))


def _layout_block(handle: ModelHandle, ids, grids, spans, anchors) -> Block:
    """The block of ``ids`` (its images, of ``grids``, already expanded): pieces and positions from 0, laid out
    directly (each image's pad run is where its markers say)."""
    proc, n = handle.processor, int(ids.shape[0])
    pieces, parts, cursor, position = [], [], 0, 0
    if grids:
        is_pad = ids == proc.image_token_id
        runs = (is_pad & ~torch.cat([is_pad.new_zeros(1), is_pad[:-1]])).nonzero().flatten().tolist()
        if len(runs) != len(grids):
            raise NotIncremental
        for image, (first_pad, grid) in enumerate(zip(runs, grids, strict=True)):
            begin, span_ids, span_positions = first_pad - 1, *image_span(handle, grid, 0)
            end = begin + int(span_ids.shape[0])
            if begin < cursor or end > n or not torch.equal(ids[begin:end], span_ids):
                raise NotIncremental  # markers or pad count not as the image's grid says
            if begin > cursor:
                pieces.append(("text", cursor, begin - cursor, None, None))
                parts.append(text_span(ids[cursor:begin], position)[1])
                position += begin - cursor
            pieces.append(("image", begin, end - begin, grid, image))
            parts.append(span_positions + position)
            position += handle.position_rule.image_slots(grid) + 2
            cursor = end
    if cursor < n:
        pieces.append(("text", cursor, n - cursor, None, None))
        parts.append(text_span(ids[cursor:], position)[1])
        position += n - cursor
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return Block(ids, positions, position, tuple(pieces), len(grids), spans[0], spans[1], anchors)
