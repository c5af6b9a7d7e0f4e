"""Incremental layouts: a turn's ``PromptLayout`` built from per-message blocks, each rendered and tokenised once.

A chat template such as Qwen-VL's renders a conversation as one chunk per message (plus the generation prompt),
each chunk depending only on its message and on whether it is the first. When that holds (``is_separable``
probes the template once per processor) and every chunk begins with a control token (so no tokenisation crosses
a message boundary), the prompt's ids are the concatenation of per-message blocks, and a block's positions are
its own positions shifted by where it starts. Templates that are not separable are rendered whole each turn
(``mmkv.prompt.layout.full_layout``), with the same result.

``LayoutBuilder`` keeps two caches, both by **content**, so they serve a session's next turn and a server's
next request alike (a server's request is a new ``Conversation`` whose messages merely say the same things):

- **blocks** by message key (``Message.text_key``, the digests of its shown images, first or not): a message
  seen before, in any conversation, is not rendered or tokenised again;
- **assemblies** (a turn's messages laid out back to back) by the chained key of every message prefix (each
  link also holds the message's image numbers): a turn that begins with the messages of an earlier turn takes
  that turn's ids, positions and pieces as they are and lays out only what follows.

So a turn costs what is new in it: its new messages' blocks, a position shift of what follows the first changed
message (a window slide), and the question. Example: request 40 of an agent resending its history re-renders
its last message only and takes the 80 messages before it from request 39's assembly as tensors.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..conversation import Conversation
from ..errors import PromptTooLongError
from ..messages import Message, TextItem
from ..model.handle import ModelHandle
from .chunks import is_separable, is_verbatim, templates_of
from .layout import (
    QUESTION_ITEM_ID,
    PromptLayout,
    PromptPiece,
    SegmentAnchor,
    check_tool_support,
    full_layout,
)
from .message import Block, NotIncremental, generation_block, message_block

__all__ = ["Block", "LayoutBuilder", "lay_out"]

MAX_BLOCKS = 8192  # message blocks kept (LRU)
MAX_ASSEMBLIES = 64  # turns' assemblies kept (LRU): a server's recent conversations
DEFAULT_CACHE_BYTES = 64 << 20  # bound on the bytes of the blocks and assemblies kept, together
_OVERHEAD = 1024  # bytes charged per cached block or assembly beyond its tensors (records, spans, keys)


@dataclass(frozen=True)
class _Assembly:
    """One turn's messages laid out (without the generation prompt). Lists indexed by message boundary have
    ``len(messages) + 1`` entries."""

    chain: tuple[bytes, ...]  # chained key after each message
    keys: tuple[bytes, ...]  # each message's block key
    token_starts: tuple[int, ...]  # token index where each message's block starts (+ the end)
    slot_starts: tuple[int, ...]  # position where each block starts (+ the end)
    image_starts: tuple[int, ...]  # prompt images before each block (+ all)
    token_ids: torch.Tensor  # (L,) the messages' ids
    positions: torch.Tensor  # (3, L)
    pieces: tuple[PromptPiece, ...]  # text runs (merged across messages) and images
    image_order: tuple[int, ...]  # conversation image index of each prompt image


class LayoutBuilder:
    """Builds each turn's ``PromptLayout`` from cached message blocks and earlier assemblies (see the module
    docstring). Holds no conversation state; thread-safe (one lock around its caches); one may serve many
    conversations (the server keeps one)."""

    def __init__(self, handle: ModelHandle, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        """``max_bytes``: bound on what the caches hold (blocks and assemblies, their ids and positions at
        32 bytes a token, and a fixed charge each), least recently used dropped first; 0 keeps nothing."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.handle = handle
        self.max_bytes = max_bytes
        self.num_bytes = 0  # what the blocks and assemblies kept hold now (as charged)
        self.incremental = is_separable(handle.processor)  # False: every turn is rendered whole
        self._templates = templates_of(handle.processor) if self.incremental else None
        self._verbatim = self.incremental and is_verbatim(handle.processor)  # chunks by structure, unchecked
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # message key -> block
        self._assemblies: OrderedDict[int, _Assembly] = OrderedDict()  # id -> assembly, LRU
        self._prefixes: dict[bytes, tuple[int, int]] = {}  # chained key -> (assembly id, messages it covers)
        self._generation: Block | None = None
        self._lock = threading.RLock()
        self.blocks_rendered = 0  # message blocks rendered so far (the rest came from the cache)

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
        what is new. Changes nothing but this builder's caches. Raises ``UnsupportedInputError`` for tools the
        family cannot take."""
        check_tool_support(self.handle, conversation)
        if self.incremental:
            try:
                with self._lock:
                    return self._assemble(
                        conversation, question, add_generation_prompt, window, trace, history_start
                    )
            except NotIncremental:
                pass
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

    def _assemble(self, conversation, question, add_generation_prompt, window, trace, history_start):
        visible = conversation.visible_images(window)
        messages = conversation.prompt_messages(history_start)
        if question is not None:
            item = TextItem(question, QUESTION_ITEM_ID)
            if messages and messages[-1].role == "user":
                messages[-1] = Message("user", (*messages[-1].items, item))
            else:
                messages.append(Message("user", (item,)))
        # 1. every message's key, and the chained key of every prefix
        shown = [tuple(i for i in m.image_indices if i in visible) for m in messages]
        keys, chain, link = [], [], b""
        for index, (message, images) in enumerate(zip(messages, shown, strict=True)):
            key = _message_key(message, index == 0, images, conversation)  # the first: with the tools
            link = hashlib.blake2b(link + key + repr(images).encode(), digest_size=16).digest()
            keys.append(key)
            chain.append(link)
        # 2. the longest prefix an earlier turn laid out already
        same, previous = 0, None
        for count in range(len(messages), 0, -1):
            found = self._prefixes.get(chain[count - 1])
            if found is not None and found[0] in self._assemblies:
                previous, same = self._assemblies[found[0]], found[1]
                self._assemblies.move_to_end(found[0])
                break
        if previous is None:
            token_starts, slot_starts, image_starts, ids, positions = [0], [0], [0], [], []
            pieces: list = []
            order: list[int] = []
        else:
            boundary = previous.token_starts[same]
            token_starts = list(previous.token_starts[: same + 1])
            slot_starts, image_starts = (
                list(previous.slot_starts[: same + 1]),
                list(previous.image_starts[: same + 1]),
            )
            ids, positions = [previous.token_ids[:boundary]], [previous.positions[:, :boundary]]
            cut = bisect.bisect_right(previous.pieces, boundary, key=lambda piece: piece.end)
            pieces = list(previous.pieces[:cut])
            if cut < len(previous.pieces) and previous.pieces[cut].begin < boundary:  # a text run crossing it
                crossing = previous.pieces[cut]
                pieces.append(("text", crossing.begin, boundary - crossing.begin, None, None))
            order = list(previous.image_order[: image_starts[-1]])
        # 3. the rest, block by block, after it
        blocks = {}
        for index in range(same, len(messages)):
            block = blocks[index] = self._block(
                messages[index], keys[index], index == 0, shown[index], conversation
            )
            _append_block(block, len(order), token_starts, slot_starts, ids, positions, pieces)
            order += shown[index]
            image_starts.append(len(order))
        message_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
        message_positions = torch.cat(positions, dim=1) if positions else torch.zeros(3, 0, dtype=torch.long)
        pieces = _materialise(pieces, message_ids)
        if same < len(messages):
            self._remember(_Assembly(
                tuple(chain), tuple(keys), tuple(token_starts), tuple(slot_starts), tuple(image_starts),
                message_ids, message_positions, tuple(pieces), tuple(order),
            ))  # fmt: skip
        # 4. the generation prompt, and the layout
        token_ids, all_positions, all_pieces = message_ids, message_positions, list(pieces)
        if add_generation_prompt:
            generation = self._generation_block()
            start = token_starts[-1]
            token_ids = torch.cat([message_ids, generation.token_ids])
            all_positions = torch.cat([message_positions, generation.positions + slot_starts[-1]], dim=1)
            tail = [
                (kind, begin + start, length, grid, None)
                for kind, begin, length, grid, _ in generation.pieces
            ]
            if all_pieces and all_pieces[-1].kind == "text" and tail and tail[0][0] == "text":
                last = all_pieces.pop()
                tail[0] = ("text", last.begin, last.length + tail[0][2], None, None)
            all_pieces += _materialise(tail, token_ids)
        item_spans = field_spans = None
        anchors: tuple[SegmentAnchor, ...] = ()
        if trace:
            item_spans, field_spans, found = {}, {}, []
            for index, message in enumerate(messages):
                block = blocks.get(index) or self._block(
                    message, keys[index], index == 0, shown[index], conversation
                )
                start, items = token_starts[index], [i for i in message.items if isinstance(i, TextItem)]
                item_spans |= {
                    items[k].item_id: (b + start, e + start) for k, (b, e) in block.item_spans.items()
                }
                field_spans |= {k: (b + start, e + start) for k, (b, e) in block.field_spans.items()}
                found += [
                    SegmentAnchor(b + start, items[k].segment, items[k].seam) for b, k in block.segments
                ]
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

    # ------------------------------------------------------------------------------------------------ caches
    def _block(
        self, message: Message, key: bytes, first: bool, shown: tuple[int, ...], conversation
    ) -> Block:
        """The block of ``message`` with its ``shown`` images (cached by ``key``)."""
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
            return block
        visible = message.showing(shown)
        grids = [conversation.images[i].grid for i in shown]
        tools = conversation.tools_json if first else ""
        block = message_block(self.handle, self._templates, self._verbatim, visible, first, grids, tools)
        self.blocks_rendered += 1
        self._blocks[key] = block
        self.num_bytes += _charge(block.token_ids)
        self._shrink()
        return block

    def _remember(self, assembly: _Assembly) -> None:
        """Keep ``assembly`` (most recent) and index every prefix of it; drop the least recently used beyond
        ``MAX_ASSEMBLIES``."""
        number = id(assembly)
        self._assemblies[number] = assembly
        self.num_bytes += _charge(assembly.token_ids)
        for count, link in enumerate(assembly.chain, start=1):
            self._prefixes[link] = (number, count)
        self._shrink()

    def _shrink(self) -> None:
        """Drop what is over the bounds, least recently used first: assemblies over ``MAX_ASSEMBLIES``; while
        over ``max_bytes``, the older assemblies (all but the newest), then blocks, then the newest assembly.
        Caller holds the lock."""
        while len(self._assemblies) > MAX_ASSEMBLIES or (
            self.num_bytes > self.max_bytes and len(self._assemblies) > 1
        ):
            self._drop_assembly()
        while self._blocks and (len(self._blocks) > MAX_BLOCKS or self.num_bytes > self.max_bytes):
            _, block = self._blocks.popitem(last=False)
            self.num_bytes -= _charge(block.token_ids)
        if self._assemblies and self.num_bytes > self.max_bytes:
            self._drop_assembly()

    def _drop_assembly(self) -> None:
        number, old = self._assemblies.popitem(last=False)
        self.num_bytes -= _charge(old.token_ids)
        for link in old.chain:
            if self._prefixes.get(link, (None,))[0] == number:
                del self._prefixes[link]

    def _generation_block(self) -> Block:
        if self._generation is None:
            self._generation = generation_block(self.handle, self._templates.generation_suffix)
        return self._generation


def _charge(token_ids: torch.Tensor) -> int:
    """Bytes charged for a cached block or assembly of these ids: ids and (3, n) positions, 8 bytes each, and
    ``_OVERHEAD``."""
    return 32 * int(token_ids.shape[0]) + _OVERHEAD


def _message_key(message: Message, first: bool, shown: tuple[int, ...], conversation: Conversation) -> bytes:
    """What a message's block depends on: its text key, whether it is first (then the declared tools too), and
    which of its images show (with their digests)."""
    parts = [
        message.text_key,
        b"1" + conversation.tools_json.encode("utf-8", "surrogatepass") if first else b"0",
    ]
    for index in message.image_indices:
        parts.append(conversation.images[index].digest.encode() if index in shown else b"-")
    return hashlib.blake2b(b"\x00".join(parts), digest_size=16).digest()


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


def _append_block(block: Block, first_image: int, token_starts, slot_starts, ids, positions, pieces) -> None:
    """Lay ``block`` out after what ``token_starts``/``slot_starts`` end at, its images numbered in the prompt
    from ``first_image`` (mutates the lists; pieces as light tuples, a text run merged with the previous one
    when they touch)."""
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
            pieces.append((kind, begin, length, grid, None if image is None else first_image + image))
    token_starts.append(start + int(block.token_ids.shape[0]))
    slot_starts.append(slot + block.num_slots)


def _span(piece) -> tuple[str, int, int]:
    """``(kind, begin, end)`` of a light tuple or a ``PromptPiece``."""
    return (
        (piece[0], piece[1], piece[1] + piece[2])
        if isinstance(piece, tuple)
        else (piece.kind, piece.begin, piece.end)
    )


def _materialise(pieces: list, ids: torch.Tensor) -> list[PromptPiece]:
    """``pieces`` with every light tuple ``(kind, begin, length, grid, prompt image number)`` turned into a
    ``PromptPiece`` (ids a view of ``ids``); ``PromptPiece`` s already made are kept as they are."""
    out = []
    for piece in pieces:
        if not isinstance(piece, tuple):
            out.append(piece)
            continue
        kind, begin, length, grid, number = piece
        out.append(PromptPiece(kind, ids[begin : begin + length], number, grid, begin))
    return out
