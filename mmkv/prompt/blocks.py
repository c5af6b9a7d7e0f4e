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
from dataclasses import dataclass

import torch

from ..conversation import Conversation, ImageItem, Message, TextItem
from ..errors import PromptTooLongError
from ..model.handle import ModelHandle
from .chunks import is_separable, is_verbatim, templates_of
from .layout import (
    QUESTION_ITEM_ID,
    PromptLayout,
    PromptPiece,
    SegmentAnchor,
    full_layout,
)
from .message import Block, NotIncremental, generation_block, message_block

__all__ = ["Block", "LayoutBuilder", "lay_out"]


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
            except NotIncremental:
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
        block = message_block(self.handle, self._templates, self._verbatim, shown, key[1], conversation)
        self._blocks[key] = (message, block)
        return block

    def _generation_block(self) -> Block:
        if self._generation is None:
            self._generation = generation_block(self.handle, self._templates.generation_suffix)
        return self._generation


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
        last_kind, last_begin, last_end = _span(last) if last is not None else (None, 0, 0)
        if kind == "text" and last_kind == "text" and last_end == begin:
            pieces[-1] = ("text", last_begin, begin + length - last_begin, None, None)
        else:
            pieces.append((kind, begin, length, grid, image))
    token_starts.append(start + int(block.token_ids.shape[0]))
    slot_starts.append(slot + block.num_slots)


def _span(piece) -> tuple[str, int, int]:
    """``(kind, begin, end)`` of a light tuple or a ``PromptPiece``."""
    return (
        (piece[0], piece[1], piece[1] + piece[2])
        if isinstance(piece, tuple)
        else (piece.kind, piece.begin, piece.end)
    )


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
