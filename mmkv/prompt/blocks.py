"""Incremental layouts: a turn's ``PromptLayout`` built from per-message blocks, each rendered and tokenised once.

A chat template such as Qwen-VL's renders a conversation as one chunk per message (plus the generation prompt),
each chunk depending only on its message and on whether it is the first. When that holds (``is_separable``
probes the template once per processor) and every chunk begins with a control token (so no tokenisation crosses
a message boundary), the prompt's ids are the concatenation of per-message blocks, and a block's positions are
its own positions shifted by where it starts. ``LayoutBuilder`` keeps each message's block (messages are
immutable, so a block stays valid as long as its message and its visible images do) and the previous turn's
assembly, so a turn costs what changed: the new messages, the question, and a position shift of everything
after the first changed message (a window slide). Templates that are not separable are rendered whole each
turn (``mmkv.prompt.layout.full_layout``), with the same result.

Example: turn 100 of a conversation re-renders only its last user message (with the question joined) and the
generation prompt; the 300 messages before it are reused as tensors, ids and positions alike.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import torch

from ..conversation import Conversation, ImageItem, Message, TextItem, grids_tensor
from ..fields import fill_template
from ..model.handle import ModelHandle
from .layout import (
    QUESTION_ITEM_ID,
    PromptLayout,
    PromptPiece,
    SegmentAnchor,
    full_layout,
    layout_positions,
    split_prompt,
)
from .render import _MARK, _MARK_PATTERN, _control_pattern, _split_at, encode_parts

__all__ = ["LayoutBuilder", "is_separable", "lay_out"]

_ANCHOR = {"role": "user", "content": [{"type": "text", "text": "\ue002"}]}  # a stand-in first message


@dataclass(frozen=True, eq=False)
class Block:
    """One message's share of a prompt, laid out from position 0."""

    token_ids: torch.Tensor  # (n,) long
    positions: torch.Tensor  # (3, n) long, relative to the block's first position
    num_slots: int  # position slots it occupies (the next block starts this much later)
    pieces: tuple[tuple, ...]  # (kind, begin relative, length, grid, conversation image index) per piece
    image_order: tuple[int, ...]  # conversation image index of each of its images
    item_spans: dict[int, tuple[int, int]]  # item_id -> token span, relative
    field_spans: dict[str, tuple[int, int]]  # field -> token span of its value, relative
    segments: tuple[SegmentAnchor, ...]  # precompiled segments it holds exactly (begin relative)


def _marked(message: Message) -> tuple[dict, dict, list[TextItem]]:
    """The template's view of ``message``: with markers for its text items, and with the texts themselves."""
    marked, direct, items = [], [], []
    for item in message.items:
        if isinstance(item, TextItem):
            marked.append({"type": "text", "text": _MARK.format(len(items))})
            direct.append({"type": "text", "text": item.text})
            items.append(item)
        else:
            marked.append({"type": "image"})
            direct.append({"type": "image"})
    return {"role": message.role, "content": marked}, {"role": message.role, "content": direct}, items


class _Templates:
    """Renders per-message chunks of one processor's chat template (the anchor renderings cached)."""

    def __init__(self, processor) -> None:
        self.processor = processor
        render = processor.apply_chat_template
        self._anchor = render([_ANCHOR], add_generation_prompt=False)
        self.generation_suffix = render([_ANCHOR], add_generation_prompt=True)[len(self._anchor) :]

    def chunk(self, message: dict, first: bool) -> str | None:
        """The text the template renders for ``message`` (as the first message or a later one), or None when
        the rendering of two messages does not start with that of the first alone."""
        render = self.processor.apply_chat_template
        if first:
            return render([message], add_generation_prompt=False)
        both = render([_ANCHOR, message], add_generation_prompt=False)
        return both[len(self._anchor) :] if both.startswith(self._anchor) else None


_PROBE = [
    {"role": "system", "content": [{"type": "text", "text": "\ue000s\ue001"}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\ue000u\ue001"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "\ue000a\ue001"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ue000v\ue001"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "\ue000b\ue001"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ue000w\ue001"}]},
]


def is_separable(processor) -> bool:
    """Whether ``processor``'s chat template renders every probe conversation as the concatenation of
    per-message chunks plus a generation suffix (cached on the processor)."""
    cached = getattr(processor, "_mmkv_separable", None)
    if cached is None:
        templates = _Templates(processor)
        cached = True
        for probe in (_PROBE, _PROBE[1:], _PROBE[2:]):
            for generation in (False, True):
                chunks = [templates.chunk(m, i == 0) for i, m in enumerate(probe)]
                if any(c is None for c in chunks):
                    cached = False
                    break
                expected = processor.apply_chat_template(probe, add_generation_prompt=generation)
                joined = "".join(chunks) + (templates.generation_suffix if generation else "")
                cached = cached and joined == expected
        processor._mmkv_separable = cached
    return cached


class _NotIncremental(Exception):
    """This turn cannot be assembled from blocks (a chunk that does not start with a control token, or a
    template that rewrites text): render it whole."""


@dataclass(frozen=True)
class _Assembly:
    """The previous turn's prompt without its generation prompt, kept so the next turn reuses its prefix."""

    keys: list[tuple]  # block key of each message
    token_starts: list[int]  # token index where each message's block starts (+ the end)
    slot_starts: list[int]  # position where each block starts (+ the end)
    token_ids: torch.Tensor  # (L,) the messages' ids
    positions: torch.Tensor  # (3, L)
    pieces: list[tuple]  # merged pieces (kind, begin, length, grid, conversation image index)
    piece_ends: list[int]  # end of each piece, for bisecting at a block boundary


class LayoutBuilder:
    """Builds each turn's ``PromptLayout`` for one session, reusing the blocks of unchanged messages and the
    previous turn's assembly. Holds no conversation state beyond those caches; not thread-safe."""

    def __init__(self, handle: ModelHandle) -> None:
        self.handle = handle
        self.incremental = is_separable(handle.processor)  # False: every turn is rendered whole
        self._templates = _Templates(handle.processor) if self.incremental else None
        self._blocks: dict[tuple, tuple[Message, Block]] = {}  # key -> (the message, kept alive; its block)
        self._previous: _Assembly | None = None
        self._generation: Block | None = None

    def build(
        self,
        conversation: Conversation,
        *,
        question: str | None = None,
        add_generation_prompt: bool = True,
        window: int | None = None,
        trace: bool = False,
    ) -> PromptLayout:
        """The layout of ``conversation`` this turn (see ``mmkv.prompt.layout.lay_out``), equal to rendering it
        whole, built from what changed. Changes nothing but this builder's caches."""
        if self.incremental:
            try:
                return self._assemble(conversation, question, add_generation_prompt, window, trace)
            except _NotIncremental:
                self._previous = None
        return full_layout(
            self.handle, conversation, question=question, add_generation_prompt=add_generation_prompt,
            window=window, trace=trace,
        )  # fmt: skip

    def _assemble(self, conversation, question, add_generation_prompt, window, trace) -> PromptLayout:
        visible = conversation.visible_images(window)
        messages = list(conversation.messages)
        if question is not None:
            item = TextItem(question, QUESTION_ITEM_ID)
            if messages and messages[-1].role == "user":
                messages[-1] = Message("user", (*messages[-1].items, item))
            else:
                messages.append(Message("user", (item,)))
        keys = [(id(m), i == 0, tuple(j in visible for j in m.image_indices)) for i, m in enumerate(messages)]
        # 1. the prefix of messages whose blocks are unchanged since the previous turn: reused as tensors
        same, previous = 0, self._previous
        if previous is not None:
            limit = min(len(keys), len(previous.keys))
            while same < limit and keys[same] == previous.keys[same]:
                same += 1
        if previous is None or same == 0:
            token_starts, slot_starts, ids, positions, pieces = [0], [0], [], [], []
        else:
            boundary = previous.token_starts[same]
            token_starts, slot_starts = previous.token_starts[: same + 1], previous.slot_starts[: same + 1]
            ids, positions = [previous.token_ids[:boundary]], [previous.positions[:, :boundary]]
            cut = bisect.bisect_right(previous.piece_ends, boundary)
            pieces = previous.pieces[:cut]
            if cut < len(previous.pieces) and previous.pieces[cut][1] < boundary:  # a text run crossing it
                kind, begin, _, grid, image = previous.pieces[cut]
                pieces.append((kind, begin, boundary - begin, grid, image))
        # 2. the blocks of the rest, laid out after it
        blocks = [
            self._block(m, k, conversation, visible)
            for m, k in zip(messages[same:], keys[same:], strict=True)
        ]
        tail = [self._generation_block()] if add_generation_prompt else []
        for block in [*blocks, *tail]:
            start, slot = token_starts[-1], slot_starts[-1]
            ids.append(block.token_ids)
            positions.append(block.positions + slot)
            for kind, begin, length, grid, image in block.pieces:
                begin += start
                if kind == "text" and pieces and pieces[-1][0] == "text" and sum(pieces[-1][1:3]) == begin:
                    last = pieces.pop()
                    pieces.append(("text", last[1], last[2] + length, None, None))
                else:
                    pieces.append((kind, begin, length, grid, image))
            token_starts.append(start + int(block.token_ids.shape[0]))
            slot_starts.append(slot + block.num_slots)
        token_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
        all_positions = torch.cat(positions, dim=1) if positions else torch.zeros(3, 0, dtype=torch.long)
        message_end = token_starts[len(messages)]
        message_pieces = [p for p in pieces if p[1] < message_end]
        if message_pieces and sum(message_pieces[-1][1:3]) > message_end:  # merged into the generation prompt
            kind, begin, _, grid, image = message_pieces.pop()
            message_pieces.append((kind, begin, message_end - begin, grid, image))
        self._previous = _Assembly(
            keys, token_starts[: len(messages) + 1], slot_starts[: len(messages) + 1], token_ids[:message_end],
            all_positions[:, :message_end], message_pieces, [b + n for _, b, n, _, _ in message_pieces],
        )  # fmt: skip
        kept = set(keys)
        self._blocks = {k: v for k, v in self._blocks.items() if k in kept}
        # 3. the layout: pieces with their ids (views), images numbered in prompt order
        out, order = [], []
        for kind, begin, length, grid, image in pieces:
            out.append(
                PromptPiece(
                    kind,
                    token_ids[begin : begin + length],
                    len(order) if kind == "image" else None,
                    grid,
                    begin,
                )
            )
            if kind == "image":
                order.append(image)
        item_spans = field_spans = None
        anchors: tuple[SegmentAnchor, ...] = ()
        if trace:
            all_blocks = [self._blocks[k][1] for k in keys] + tail
            item_spans, field_spans, found = {}, {}, []
            for block, start in zip(all_blocks, token_starts, strict=False):
                item_spans |= {k: (b + start, e + start) for k, (b, e) in block.item_spans.items()}
                field_spans |= {k: (b + start, e + start) for k, (b, e) in block.field_spans.items()}
                found += [SegmentAnchor(a.begin + start, a.segment, a.seam) for a in block.segments]
            anchors = tuple(found)
        return PromptLayout(
            token_ids, all_positions, tuple(out), tuple(order), item_spans, field_spans, anchors
        )

    # ------------------------------------------------------------------------------------------------ blocks
    def _block(self, message: Message, key: tuple, conversation: Conversation, visible: range) -> Block:
        held = self._blocks.get(key)
        if held is not None and held[0] is message:
            return held[1]
        shown = Message(
            message.role,
            tuple(i for i in message.items if not isinstance(i, ImageItem) or i.image_index in visible),
        )
        block = self._make_block(shown, key[1], conversation)
        self._blocks[key] = (message, block)
        return block

    def _generation_block(self) -> Block:
        if self._generation is None:
            self._check_starts_with_control(self._templates.generation_suffix)
            ids, _ = encode_parts(self.handle.processor, [(self._templates.generation_suffix, True)])
            self._generation = self._layout_block(
                ids, conversation=None, order=(), spans=({}, {}), anchors=()
            )
        return self._generation

    def _check_starts_with_control(self, text: str) -> None:
        if text and not _control_pattern(self.handle.processor).match(text):
            raise _NotIncremental

    def _make_block(self, message: Message, first: bool, conversation: Conversation) -> Block:
        marked, direct, items = _marked(message)
        chunk = self._templates.chunk(marked, first)
        direct_chunk = self._templates.chunk(direct, first)
        if chunk is None or direct_chunk is None:
            raise _NotIncremental
        self._check_starts_with_control(chunk)
        pieces = re.split(_MARK_PATTERN, chunk)
        parts: list[tuple[str, bool]] = []
        tags: list[tuple[TextItem, str | None] | None] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                parts.append((piece, True))
                tags.append(None)
                continue
            item = items[int(piece)]
            spans = fill_template(item.template, item.field_map)[1] if item.fields else {}
            for text, name in _split_at(item.text, spans):
                parts.append((text, False))
                tags.append((item, name))
        if "".join(text for text, _ in parts) != direct_chunk:
            raise _NotIncremental  # the template rewrites message text
        order = message.image_indices
        counts = [self.handle.position_rule.num_image_tokens(conversation.images[i].grid) for i in order]
        ids, spans = encode_parts(self.handle.processor, parts, offsets=True, pad_counts=counts)
        item_spans: dict[int, tuple[int, int]] = {}
        field_spans: dict[str, tuple[int, int]] = {}
        for part, tag in enumerate(tags):
            if tag is None or part not in spans:
                continue
            item, name = tag
            begin, end = spans[part]
            old = item_spans.get(item.item_id)
            item_spans[item.item_id] = (begin, end) if old is None else (min(old[0], begin), max(old[1], end))
            if name is not None:
                field_spans[name] = (begin, end)
        anchors = []
        for item in items:
            if item.segment is not None and item.item_id in item_spans:
                begin, end = item_spans[item.item_id]
                if torch.equal(ids[begin:end], item.segment.token_ids):
                    anchors.append(SegmentAnchor(begin, item.segment, item.seam))
        return self._layout_block(ids, conversation, order, (item_spans, field_spans), tuple(anchors))

    def _layout_block(self, ids, conversation, order, spans, anchors) -> Block:
        grids = (
            grids_tensor(conversation.images, list(order)) if order else torch.zeros(0, 3, dtype=torch.long)
        )
        split = split_prompt(self.handle, ids, grids)
        positions = (
            torch.cat(layout_positions(self.handle, split), dim=1)
            if split
            else torch.zeros(3, 0, dtype=torch.long)
        )
        rule = self.handle.position_rule
        slots = sum(rule.image_slots(p.grid_thw) + 2 if p.kind == "image" else p.length for p in split)
        pieces = tuple(
            (p.kind, p.begin, p.length, p.grid_thw, order[p.image_index] if p.kind == "image" else None)
            for p in split
        )
        return Block(ids, positions, slots, pieces, tuple(order), spans[0], spans[1], anchors)


def lay_out(
    handle: ModelHandle,
    conversation: Conversation,
    *,
    question: str | None = None,
    add_generation_prompt: bool = True,
    window: int | None = None,
    trace: bool = False,
) -> PromptLayout:
    """The layout of ``conversation`` as the model sees it this turn: only the last ``window`` images, and
    ``question`` (if given) joined to the last message when it is the user's, else as a new user message;
    ``trace`` also gives the token spans of text items and fields and where precompiled segments sit. A
    one-off ``LayoutBuilder``; a session keeps one to reuse what did not change. Changes nothing."""
    return LayoutBuilder(handle).build(
        conversation,
        question=question,
        add_generation_prompt=add_generation_prompt,
        window=window,
        trace=trace,
    )
