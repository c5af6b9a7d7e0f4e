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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ..conversation import Conversation
from ..errors import PromptTooLongError
from ..messages import Message, TextItem
from ..model.handle import ModelHandle
from .chunks import is_separable, is_verbatim, templates_of
from .layout import PromptLayout, PromptPiece, SegmentAnchor, check_tool_support, turn_messages
from .message import Block, NotIncremental, generation_block, message_block, whole_block

__all__ = ["LayoutBuilder", "full_layout", "lay_out"]

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


@dataclass
class _Laid:
    """Blocks laid out back to back while a turn is assembled (mutable; lists by message boundary have one entry
    more than the blocks laid). A text run that touches the one before is merged with it."""

    token_starts: list[int] = field(default_factory=lambda: [0])  # where each block starts (+ the end)
    slot_starts: list[int] = field(
        default_factory=lambda: [0]
    )  # the position each block starts at (+ the end)
    image_starts: list[int] = field(default_factory=lambda: [0])  # prompt images before each block (+ all)
    ids: list[torch.Tensor] = field(default_factory=list)  # (n,) per block
    positions: list[torch.Tensor] = field(default_factory=list)  # (3, n) per block, shifted
    pieces: list[PromptPiece] = field(default_factory=list)  # in the prompt
    order: list[int] = field(default_factory=list)  # conversation image index of each prompt image

    @classmethod
    def prefix_of(cls, assembly: _Assembly, count: int) -> _Laid:
        """The first ``count`` messages of an earlier turn's ``assembly``, as laid out then."""
        boundary = assembly.token_starts[count]
        cut = bisect.bisect_right(assembly.pieces, boundary, key=lambda piece: piece.end)
        pieces = list(assembly.pieces[:cut])
        if cut < len(assembly.pieces) and assembly.pieces[cut].begin < boundary:  # a text run crossing it
            crossing = assembly.pieces[cut]
            pieces.append(replace(crossing, length=boundary - crossing.begin))
        return cls(
            list(assembly.token_starts[: count + 1]), list(assembly.slot_starts[: count + 1]),
            list(assembly.image_starts[: count + 1]), [assembly.token_ids[:boundary]],
            [assembly.positions[:, :boundary]], pieces, list(assembly.image_order[: assembly.image_starts[count]]),
        )  # fmt: skip

    def append(self, block: Block, shown: Sequence[int]) -> None:
        """Lay ``block`` out after what is laid, its images (conversation indices ``shown``) numbered on."""
        start, slot, first = self.token_starts[-1], self.slot_starts[-1], len(self.order)
        self.ids.append(block.token_ids)
        self.positions.append(block.positions + slot)
        for piece in block.pieces:
            piece = piece.shifted(start, first)
            last = self.pieces[-1] if self.pieces else None
            if piece.kind == "text" and last is not None and last.kind == "text" and last.end == piece.begin:
                self.pieces[-1] = replace(last, length=last.length + piece.length)
            else:
                self.pieces.append(piece)
        self.token_starts.append(start + block.num_tokens)
        self.slot_starts.append(slot + block.num_slots)
        self.order += shown
        self.image_starts.append(len(self.order))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L,)`` ids and ``(3, L)`` positions of what is laid."""
        if not self.ids:
            return torch.zeros(0, dtype=torch.long), torch.zeros(3, 0, dtype=torch.long)
        return torch.cat(self.ids), torch.cat(self.positions, dim=1)

    def assembly(self, chain: tuple[bytes, ...], keys: tuple[bytes, ...]) -> _Assembly:
        """What is laid, kept for later turns under the messages' ``chain`` and block ``keys``."""
        ids, positions = self.tensors()
        return _Assembly(
            chain, keys, tuple(self.token_starts), tuple(self.slot_starts), tuple(self.image_starts), ids,
            positions, tuple(self.pieces), tuple(self.order),
        )  # fmt: skip


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
        messages = turn_messages(conversation, question, history_start)
        shown = _shown(messages, conversation.visible_images(window))
        if self.incremental:
            try:
                with self._lock:
                    return self._assemble(conversation, messages, shown, add_generation_prompt, trace)
            except NotIncremental:
                pass
        return _whole_layout(self.handle, conversation, messages, shown, add_generation_prompt, trace)

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

    def _assemble(self, conversation, messages, shown, add_generation_prompt, trace) -> PromptLayout:
        """The layout from message blocks: the longest prefix an earlier turn laid out taken as it is, the rest
        block by block after it, then the generation prompt. Raises ``NotIncremental`` (caches unchanged but
        for blocks made) where a message cannot be a block."""
        # 1. every message's key, and the chained key of every prefix
        keys, chain, link = [], [], b""
        for index, (message, images) in enumerate(zip(messages, shown, strict=True)):
            key = _message_key(message, index == 0, images, conversation)  # the first: with the tools
            link = hashlib.blake2b(link + key + repr(images).encode(), digest_size=16).digest()
            keys.append(key)
            chain.append(link)
        # 2. the longest prefix an earlier turn laid out already
        laid, same = _Laid(), 0
        for count in range(len(messages), 0, -1):
            found = self._prefixes.get(chain[count - 1])
            if found is not None and found[0] in self._assemblies:
                laid, same = _Laid.prefix_of(self._assemblies[found[0]], found[1]), found[1]
                self._assemblies.move_to_end(found[0])
                break
        # 3. the rest, block by block, after it
        blocks = {}
        for index in range(same, len(messages)):
            blocks[index] = self._block(messages[index], keys[index], index == 0, shown[index], conversation)
            laid.append(blocks[index], shown[index])
        if same < len(messages):
            self._remember(laid.assembly(tuple(chain), tuple(keys)))
        # 4. the generation prompt, and the layout
        traced = []
        if trace:
            for index, message in enumerate(messages):
                block = blocks.get(index) or self._block(
                    message, keys[index], index == 0, shown[index], conversation
                )
                traced.append((block, [message], laid.token_starts[index]))
        if add_generation_prompt:
            laid.append(self._generation_block(), ())
        return _layout(conversation, laid, traced if trace else None)

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


def _shown(messages: Sequence[Message], visible) -> list[tuple[int, ...]]:
    """Each message's images that show this turn (conversation indices, in order)."""
    return [tuple(i for i in m.image_indices if i in visible) for m in messages]


def _layout(conversation: Conversation, laid: _Laid, traced) -> PromptLayout:
    """The ``PromptLayout`` of ``laid``; ``traced`` (or None: untraced): ``(block, the messages it covers, where
    it starts)`` for every block holding text items, whose spans and segments the layout then carries (all
    None when a block could not trace them)."""
    token_ids, positions = laid.tensors()
    item_spans = field_spans = None
    anchors: list[SegmentAnchor] = []
    if traced is not None and all(block.item_spans is not None for block, _, _ in traced):
        item_spans, field_spans = {}, {}
        for block, messages, start in traced:
            items = [i for m in messages for i in m.items if isinstance(i, TextItem)]
            item_spans |= {items[k].item_id: (b + start, e + start) for k, (b, e) in block.item_spans.items()}
            field_spans |= {name: (b + start, e + start) for name, (b, e) in block.field_spans.items()}
            anchors += [SegmentAnchor(b + start, items[k].segment, items[k].seam) for b, k in block.segments]
    return PromptLayout(
        token_ids, positions, tuple(laid.pieces), tuple(laid.order), item_spans, field_spans,
        tuple(sorted(anchors, key=lambda a: a.begin)), tuple(conversation.images[i].digest for i in laid.order),
    )  # fmt: skip


def _whole_layout(handle, conversation, messages, shown, add_generation_prompt, trace) -> PromptLayout:
    """The layout from one block covering the whole turn (``whole_block``), laid out as any block is."""
    visible = [message.showing(images) for message, images in zip(messages, shown, strict=True)]
    order = [i for images in shown for i in images]
    grids = [conversation.images[i].grid for i in order]
    block = whole_block(handle, visible, grids, add_generation_prompt, trace, conversation.tools_json)
    laid = _Laid()
    laid.append(block, order)
    return _layout(conversation, laid, [(block, visible, 0)] if trace else None)


def full_layout(
    handle: ModelHandle,
    conversation: Conversation,
    *,
    question: str | None = None,
    add_generation_prompt: bool = True,
    window: int | None = None,
    trace: bool = False,
    history_start: int = 0,
) -> PromptLayout:
    """``lay_out`` by rendering the whole turn at once, as one block (the path of templates that cannot be cut
    into message blocks, and the reference the blocks are tested against). Changes nothing. Raises
    ``UnsupportedInputError`` for tools the family cannot take (``check_tool_support``)."""
    check_tool_support(handle, conversation)
    messages = turn_messages(conversation, question, history_start)
    shown = _shown(messages, conversation.visible_images(window))
    return _whole_layout(handle, conversation, messages, shown, add_generation_prompt, trace)


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
