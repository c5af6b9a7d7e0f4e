"""One message's block: its share of a prompt, rendered, tokenised (text only ever as text) and laid out from
position 0, so that ``mmkv.prompt.blocks`` can assemble a turn's layout from the blocks of its messages.

A block depends on the message's content alone (its role, its texts, the grids of its shown images, whether it
is the prompt's first message), never on the conversation it came from: images are numbered within the message
and text items by their order in it, so one block serves every conversation that holds the same message (the
server's requests, each a new conversation, resending the same history)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..messages import Message, TextItem
from ..model.handle import ModelHandle
from .chunks import Templates
from .layout import PromptPiece, lay_out_ids
from .render import collect_spans, encode_parts, render_prompt, split_marked, starts_with_added_token
from .views import render_views, tool_views

__all__ = ["Block", "NotIncremental", "generation_block", "message_block", "whole_block"]


@dataclass(frozen=True, eq=False)
class Block:
    """One message's share of a prompt (or a whole turn's, for a template that cannot be cut into messages),
    laid out from position 0. Its text items are numbered in order over the messages it covers (``k``)."""

    token_ids: torch.Tensor  # (n,) long
    positions: torch.Tensor  # (3, n) long, relative to the block's first position
    num_slots: int  # position slots it occupies (the next block starts this much later)
    pieces: tuple[PromptPiece, ...]  # relative to the block; prompt_image k: its k-th shown image
    item_spans: dict[int, tuple[int, int]] | None  # k -> token span of its k-th text item, relative (None:
    # not traced, or the template rewrites text so spans are unknown)
    field_spans: (
        dict[str, tuple[int, int]] | None
    )  # field -> token span of its value, relative (None likewise)
    segments: tuple[tuple[int, int], ...]  # (begin relative, k) of each precompiled segment held exactly by
    # its k-th text item

    @property
    def num_tokens(self) -> int:
        """Tokens in the block."""
        return int(self.token_ids.shape[0])


class NotIncremental(Exception):
    """This turn cannot be assembled from blocks (a chunk that does not start with a control token, or a
    template that rewrites text): render it whole."""


def generation_block(handle: ModelHandle, suffix: str) -> Block:
    """The block of the generation prompt (``suffix``, e.g. ``<|im_start|>assistant``)."""
    _check_starts_with_control(handle, suffix)
    ids, _ = encode_parts(handle.processor, [(suffix, True)])
    return _layout_block(handle, ids, (), [], {}, {}, NotIncremental)


def _check_starts_with_control(handle: ModelHandle, text: str) -> None:
    if text and not starts_with_added_token(handle.processor, text):
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
    return _layout_block(handle, ids, tuple(grids), [message], by_id, field_spans, NotIncremental)


def whole_block(
    handle: ModelHandle, messages: list[Message], grids: list, add_generation_prompt: bool, trace: bool,
    tools_json: str = "",
) -> Block:  # fmt: skip
    """One block covering a whole turn: ``messages`` (their shown images of ``grids``, in order) and, with
    ``add_generation_prompt``, the generation prompt, rendered at once (the path for templates that cannot be
    cut into message blocks, and the reference the blocks are tested against). ``ValueError`` when the
    rendering's pads do not match the grids; changes nothing."""
    rendered = render_prompt(
        handle.processor, messages, _grids_tensor(grids), add_generation_prompt, trace, tools_json
    )
    return _layout_block(
        handle,
        rendered.token_ids,
        tuple(grids),
        messages,
        rendered.item_spans,
        rendered.field_spans,
        ValueError,
    )


def _grids_tensor(grids: list) -> torch.Tensor:
    """``(N, 3)`` long from a list of ``(t, h, w)`` grids."""
    return torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3)


def _layout_block(handle: ModelHandle, ids, grids, messages, by_id, field_spans, failure) -> Block:
    """The block of ``ids`` (its images, of ``grids``, already expanded) covering ``messages``: pieces and positions
    from 0, its text items' spans (``by_id``: item id -> span, or None) by their number ``k`` among the messages'
    text items, and the precompiled segments it holds exactly. Raises ``failure`` when the pads are not where
    the grids say."""
    try:
        pieces, positions, slots = lay_out_ids(handle, ids, grids)
    except ValueError as exc:
        raise failure(str(exc)) from None
    item_spans = anchors = None
    if by_id is not None:
        texts = [i for m in messages for i in m.items if isinstance(i, TextItem)]
        ordinal = {item.item_id: k for k, item in enumerate(texts)}
        item_spans = {ordinal[item_id]: span for item_id, span in by_id.items() if item_id in ordinal}
        anchors = []
        for k, item in enumerate(texts):
            if item.segment is not None and k in item_spans:
                begin, end = item_spans[k]
                if torch.equal(ids[begin:end], item.segment.token_ids):
                    anchors.append((begin, k))
    return Block(ids, positions, slots, pieces, item_spans, field_spans, tuple(anchors or ()))
