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

from ..conversation import Conversation, ImageItem, Message, TextItem
from ..errors import PromptTooLongError
from ..fields import fill_template
from ..kv.spans import image_span, text_span
from ..model.handle import ModelHandle
from .chunks import is_separable, is_verbatim, render_views, templates_of
from .layout import (
    QUESTION_ITEM_ID,
    PromptLayout,
    PromptPiece,
    SegmentAnchor,
    full_layout,
)
from .render import _MARK_PATTERN, _control_pattern, _split_at, encode_parts

__all__ = ["Block", "LayoutBuilder", "lay_out"]


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


class _NotIncremental(Exception):
    """This turn cannot be assembled from blocks (a chunk that does not start with a control token, or a
    template that rewrites text): render it whole."""


@dataclass(frozen=True)
class _Assembly:
    """The previous turn's messages laid out (without the generation prompt), so the next turn reuses its prefix.
    Every list has one entry per message boundary (``len(messages) + 1``) unless said otherwise."""

    messages: list[Message]  # one per message
    shown: list[tuple[bool, ...]]  # per message: which of its images were visible
    token_starts: list[int]  # token index where each message's block starts (+ the end)
    slot_starts: list[int]  # position where each block starts (+ the end)
    image_starts: list[int]  # images before each block (+ all)
    token_ids: torch.Tensor  # (L,) the messages' ids
    positions: torch.Tensor  # (3, L)
    pieces: list[PromptPiece]  # merged text runs and images over the messages
    image_order: list[int]  # conversation image index of each image, in prompt order


class LayoutBuilder:
    """Builds each turn's ``PromptLayout`` for one session, reusing the blocks of unchanged messages and the
    previous turn's assembly. Holds no conversation state beyond those caches; not thread-safe."""

    def __init__(self, handle: ModelHandle) -> None:
        self.handle = handle
        self.incremental = is_separable(handle.processor)  # False: every turn is rendered whole
        self._templates = templates_of(handle.processor) if self.incremental else None
        self._verbatim = self.incremental and is_verbatim(handle.processor)  # chunks by structure, unchecked
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
        history_start: int = 0,
    ) -> PromptLayout:
        """The layout of ``conversation`` this turn (see ``lay_out``), equal to rendering it whole, built from
        what changed. Changes nothing but this builder's caches."""
        if self.incremental:
            try:
                return self._assemble(
                    conversation, question, add_generation_prompt, window, trace, history_start
                )
            except _NotIncremental:
                self._previous = None
        return full_layout(
            self.handle, conversation, question=question, add_generation_prompt=add_generation_prompt,
            window=window, trace=trace, history_start=history_start,
        )  # fmt: skip

    def build_within(
        self, budget: int | None, conversation: Conversation, *, history_start: int = 0, **options
    ):
        """``build``, dropping the oldest turns (from message ``history_start`` on; pinned messages stay) until
        the prompt has at most ``budget`` tokens. Returns ``(layout, history_start)`` (the new start); raises
        ``PromptTooLongError`` when even every droppable turn dropped is not enough. ``budget=None``: no bound."""
        layout = self.build(conversation, history_start=history_start, **options)
        while budget is not None and layout.num_tokens > budget:
            start = conversation.next_turn_start(history_start)
            if start is None:
                raise PromptTooLongError(
                    f"the prompt has {layout.num_tokens} tokens with every droppable turn dropped, over "
                    f"max_prompt_tokens={budget}; shorten the pinned text or the last message, or raise it"
                )
            history_start = start
            layout = self.build(conversation, history_start=history_start, **options)
        return layout, history_start

    def _assemble(
        self, conversation, question, add_generation_prompt, window, trace, history_start
    ) -> PromptLayout:
        visible = conversation.visible_images(window)
        messages = conversation.prompt_messages(history_start)
        if question is not None:
            item = TextItem(question, QUESTION_ITEM_ID)
            if messages and messages[-1].role == "user":
                messages[-1] = Message("user", (*messages[-1].items, item))
            else:
                messages.append(Message("user", (item,)))
        # 1. the leading messages unchanged since the previous turn (same objects, same images shown)
        previous, same = self._previous, 0
        if previous is not None:
            limit = min(len(messages), len(previous.messages))
            while same < limit and messages[same] is previous.messages[same]:
                if messages[same].image_indices and _shown(messages[same], visible) != previous.shown[same]:
                    break
                same += 1
        if previous is None or same == 0:
            token_starts, slot_starts, image_starts, ids, positions = [0], [0], [0], [], []
            pieces: list = []
            order: list[int] = []
        else:
            boundary = previous.token_starts[same]
            token_starts = previous.token_starts[: same + 1]
            slot_starts, image_starts = previous.slot_starts[: same + 1], previous.image_starts[: same + 1]
            ids, positions = [previous.token_ids[:boundary]], [previous.positions[:, :boundary]]
            cut = bisect.bisect_right(previous.pieces, boundary, key=lambda piece: piece.end)
            pieces = previous.pieces[:cut]
            if cut < len(previous.pieces) and previous.pieces[cut].begin < boundary:  # a text run crossing it
                crossing = previous.pieces[cut]
                pieces.append(("text", crossing.begin, boundary - crossing.begin, None, None))
            order = previous.image_order[: image_starts[-1]]
        # 2. the rest, block by block, after it
        shown = [] if previous is None else previous.shown[:same]
        for index in range(same, len(messages)):
            message, shows = messages[index], _shown(messages[index], visible)
            block = self._block(message, (id(message), index == 0, shows), conversation, visible)
            shown.append(shows)
            _append_block(block, token_starts, slot_starts, ids, positions, pieces)
            order += block.image_order
            image_starts.append(len(order))
        message_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
        message_positions = torch.cat(positions, dim=1) if positions else torch.zeros(3, 0, dtype=torch.long)
        pieces = _materialise(pieces, message_ids, image_starts[same] if same else 0)
        self._previous = _Assembly(
            messages,
            shown,
            token_starts,
            slot_starts,
            image_starts,
            message_ids,
            message_positions,
            pieces,
            order,
        )
        if len(self._blocks) > 2 * len(messages) + 16:  # drop blocks of messages gone from the conversation
            kept = {id(m) for m in messages}
            self._blocks = {k: v for k, v in self._blocks.items() if k[0] in kept}
        # 3. the generation prompt, and the layout
        token_ids, all_positions, all_pieces = message_ids, message_positions, list(pieces)
        if add_generation_prompt:
            generation = self._generation_block()
            start = token_starts[-1]
            token_ids = torch.cat([message_ids, generation.token_ids])
            all_positions = torch.cat([message_positions, generation.positions + slot_starts[-1]], dim=1)
            tail = [
                (kind, begin + start, length, grid, image)
                for kind, begin, length, grid, image in generation.pieces
            ]
            if all_pieces and all_pieces[-1].kind == "text" and tail and tail[0][0] == "text":
                last = all_pieces.pop()
                tail[0] = ("text", last.begin, last.length + tail[0][2], None, None)
            all_pieces += _materialise(tail, token_ids, len(order))
        item_spans = field_spans = None
        anchors: tuple[SegmentAnchor, ...] = ()
        if trace:
            blocks = [self._blocks[(id(m), i == 0, shown[i])][1] for i, m in enumerate(messages)]
            if add_generation_prompt:
                blocks.append(self._generation_block())
            item_spans, field_spans, found = {}, {}, []
            for block, start in zip(blocks, token_starts, strict=False):
                item_spans |= {k: (b + start, e + start) for k, (b, e) in block.item_spans.items()}
                field_spans |= {k: (b + start, e + start) for k, (b, e) in block.field_spans.items()}
                found += [SegmentAnchor(a.begin + start, a.segment, a.seam) for a in block.segments]
            anchors = tuple(found)
        digests = tuple(conversation.images[i].digest for i in order)
        return PromptLayout(
            token_ids,
            all_positions,
            tuple(all_pieces),
            tuple(order),
            item_spans,
            field_spans,
            anchors,
            digests,
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
        items = [i for i in message.items if isinstance(i, TextItem)]
        chunk = self._templates.structure_chunk(message, first)
        direct_chunk = None if self._verbatim else self._templates.chunk(render_views(message)[1], first)
        if chunk is None or (direct_chunk is None and not self._verbatim):
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
        if not self._verbatim and "".join(text for text, _ in parts) != direct_chunk:
            raise _NotIncremental  # the template rewrites this message's text
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
        """The block of ``ids`` (its images, in ``order``, already expanded): pieces and positions from 0, laid
        out directly (each image's pad run is where its markers say)."""
        proc, n = self.handle.processor, int(ids.shape[0])
        grids = [conversation.images[i].grid for i in order]
        pieces, parts, cursor, position = [], [], 0, 0
        if grids:
            is_pad = ids == proc.image_token_id
            runs = (is_pad & ~torch.cat([is_pad.new_zeros(1), is_pad[:-1]])).nonzero().flatten().tolist()
            if len(runs) != len(grids):
                raise _NotIncremental
            for first_pad, grid, image in zip(runs, grids, order, strict=True):
                begin, span_ids, span_positions = first_pad - 1, *image_span(self.handle, grid, 0)
                end = begin + int(span_ids.shape[0])
                if begin < cursor or end > n or not torch.equal(ids[begin:end], span_ids):
                    raise _NotIncremental  # markers or pad count not as the image's grid says
                if begin > cursor:
                    pieces.append(("text", cursor, begin - cursor, None, None))
                    parts.append(text_span(ids[cursor:begin], position)[1])
                    position += begin - cursor
                pieces.append(("image", begin, end - begin, grid, image))
                parts.append(span_positions + position)
                position += self.handle.position_rule.image_slots(grid) + 2
                cursor = end
        if cursor < n:
            pieces.append(("text", cursor, n - cursor, None, None))
            parts.append(text_span(ids[cursor:], position)[1])
            position += n - cursor
        positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        return Block(ids, positions, position, tuple(pieces), tuple(order), spans[0], spans[1], anchors)


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


def _shown(message: Message, visible: range) -> tuple[bool, ...]:
    """Which of ``message``'s images the window shows."""
    return tuple(i in visible for i in message.image_indices)


def _append_block(block: Block, token_starts, slot_starts, ids, positions, pieces) -> None:
    """Lay ``block`` out after what ``token_starts``/``slot_starts`` end at (mutates the lists; pieces as light
    tuples, a text run merged with the previous one when they touch)."""
    start, slot = token_starts[-1], slot_starts[-1]
    ids.append(block.token_ids)
    positions.append(block.positions + slot)
    for kind, begin, length, grid, image in block.pieces:
        begin += start
        last = pieces[-1] if pieces else None
        if kind == "text" and last is not None and _kind(last) == "text" and _end(last) == begin:
            pieces[-1] = ("text", _begin(last), begin + length - _begin(last), None, None)
        else:
            pieces.append((kind, begin, length, grid, image))
    token_starts.append(start + int(block.token_ids.shape[0]))
    slot_starts.append(slot + block.num_slots)


def _kind(piece) -> str:
    return piece[0] if isinstance(piece, tuple) else piece.kind


def _begin(piece) -> int:
    return piece[1] if isinstance(piece, tuple) else piece.begin


def _end(piece) -> int:
    return piece[1] + piece[2] if isinstance(piece, tuple) else piece.end


def _materialise(pieces: list, ids: torch.Tensor, first_image: int) -> list[PromptPiece]:
    """``pieces`` with every light tuple turned into a ``PromptPiece`` (ids a view of ``ids``; images numbered
    from ``first_image`` in order); ``PromptPiece`` s already made are kept as they are."""
    out, image = [], first_image
    for piece in pieces:
        if not isinstance(piece, tuple):
            out.append(piece)
            continue
        kind, begin, length, grid, _ = piece
        number = None
        if kind == "image":
            number, image = image, image + 1
        out.append(PromptPiece(kind, ids[begin : begin + length], number, grid, begin))
    return out
