"""A turn's prompt as mmkv works on it: ``PromptLayout`` (ids, positions, pieces, spans), built once per turn.

``lay_out`` renders a ``Conversation`` (the images outside the window left out, the question joined to the
user's last message) with the model's own chat template, cuts the ids into ``PromptPiece`` s and gives them
their M-RoPE positions. An image piece is ``<|vision_start|>`` + its pads + ``<|vision_end|>`` (the unit whose
KV is cached); everything else is text. Positions equal the model's ``get_rope_index``. Example, a text run of
3 tokens, a 2x3 image and one more token (Qwen2.5-VL-style, merge 2)::

    pieces     text [0, 3)          image [3, 11)                         text [11, 12)
    positions  T 0 1 2 | 3  4 4 4 4 4 4  7 | 8
               H 0 1 2 | 3  4 4 4 5 5 5  7 | 8
               W 0 1 2 | 3  4 5 6 4 5 6  7 | 8

(the image's markers are text positions; the image takes ``max(h', w') = 3`` slots, so the end marker is at 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..conversation import Conversation
from ..errors import UnsupportedInputError
from ..kv.segment import KVSegment
from ..kv.spans import image_span
from ..messages import Message, TextItem
from ..model.handle import ModelHandle

__all__ = [
    "QUESTION_ITEM_ID", "PromptLayout", "PromptPiece", "SegmentAnchor", "check_tool_support", "lay_out_ids",
    "layout_positions", "split_prompt", "turn_messages",
]  # fmt: skip

QUESTION_ITEM_ID = -1  # item_id of the question joined to the prompt (its span is traced like any text)


@dataclass(frozen=True)
class PromptPiece:
    """One piece of a prompt, as a span: a text run, or one marker-wrapped image. The one piece record: a
    message block's pieces (relative to the block), a layout's and a live cache's are all ``PromptPiece`` s; the
    ids are the holder's (``PromptLayout.ids_of``)."""

    kind: Literal["text", "image"]  # a text run, or one marker-wrapped image
    begin: int  # index of its first token (in the prompt, or in its block)
    length: int  # tokens in the piece
    prompt_image: int | None = None  # image pieces: which image of the prompt (0-based, in prompt order)
    grid_thw: tuple[int, int, int] | None = None  # image pieces: the image's vision grid

    @property
    def end(self) -> int:
        """Index after its last token."""
        return self.begin + self.length

    def shifted(self, tokens: int, images: int = 0) -> PromptPiece:
        """The piece ``tokens`` later, its image number ``images`` higher (a block laid out in a prompt).

        >>> PromptPiece("image", 1, 8, 0, (1, 4, 4)).shifted(10, 2)
        PromptPiece(kind='image', begin=11, length=8, prompt_image=2, grid_thw=(1, 4, 4))
        """
        number = None if self.prompt_image is None else self.prompt_image + images
        return replace(self, begin=self.begin + tokens, prompt_image=number)


def split_prompt(
    handle: ModelHandle, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | Sequence | None
) -> list[PromptPiece]:
    """Cut ``input_ids`` (``(L,)`` or ``(1, L)``) into text and image pieces, in order, tiling ``[0, L)``; the
    ``k``-th image is grid ``image_grid_thw[k]``. Raises ``ValueError`` when the pads do not match the grids.

    A ``<|vision_start|>`` not followed by a pad (a video, literal text) stays text. The checks are vectorised:
    a prompt with many images costs a few tensor operations, not a loop of them."""
    ids = input_ids.reshape(-1).long()
    proc = handle.processor
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw]
    n = int(ids.shape[0])
    starts = (
        (ids[:-1] == proc.vision_start_token_id) & (ids[1:] == proc.image_token_id) if n > 1 else ids[:0] > 0
    )
    starts = starts.nonzero().flatten()  # (images,) index of each <|vision_start|>
    if int(starts.numel()) > len(grids):
        raise ValueError(
            f"the prompt has more images ({int(starts.numel())}) than the {len(grids)} grids given"
        )
    if int(starts.numel()) < len(grids):
        raise ValueError(f"the prompt has {int(starts.numel())} images but {len(grids)} grids were given")
    counts = [handle.position_rule.num_image_tokens(g) for g in grids]
    if grids:
        ends = starts + 1 + torch.tensor(counts)  # (images,) index of each <|vision_end|>
        pads = torch.cat([torch.zeros(1, dtype=torch.long), (ids == proc.image_token_id).long().cumsum(0)])
        inside = pads[ends] - pads[starts + 1]  # pads between the markers
        closed = ends < n
        closed[closed.clone()] = ids[ends[closed]] == proc.vision_end_token_id
        bad = ((inside != torch.tensor(counts)) | ~closed).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"image {i}: expected {counts[i]} pads between the vision markers (grid {grids[i]})"
            )
    pieces: list[PromptPiece] = []
    cursor = 0
    for number, (start, count) in enumerate(zip(starts.tolist(), counts, strict=True)):
        if start > cursor:
            pieces.append(PromptPiece("text", cursor, start - cursor))
        pieces.append(PromptPiece("image", start, count + 2, number, grids[number]))
        cursor = start + count + 2
    if cursor < n:
        pieces.append(PromptPiece("text", cursor, n - cursor))
    return pieces


def layout_positions(
    handle: ModelHandle, pieces: Sequence[PromptPiece], start: int = 0
) -> list[torch.Tensor]:
    """The ``(3, length)`` position ids of each piece when laid out back to back from ``start``."""
    return _positions(handle, pieces, start)[0]


def lay_out_ids(
    handle: ModelHandle, token_ids: torch.Tensor, grids: Sequence | torch.Tensor | None
) -> tuple[tuple[PromptPiece, ...], torch.Tensor, int]:
    """``token_ids`` (``(n,)``, its images' pads expanded for ``grids``) laid out from position 0: its pieces, its
    ``(3, n)`` positions, and the position slots it occupies (what follows starts there). The one layout rule
    a message block and a whole rendering share. Raises ``ValueError`` as ``split_prompt`` does."""
    pieces = split_prompt(handle, token_ids, grids)
    parts, slots = _positions(handle, pieces, 0)
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return tuple(pieces), positions, slots


def _positions(
    handle: ModelHandle, pieces: Sequence[PromptPiece], start: int
) -> tuple[list[torch.Tensor], int]:
    """Each piece's ``(3, length)`` positions from ``start``, and the position after the last piece."""
    positions, position = [], start
    for piece in pieces:
        if piece.kind == "image":
            _, pos = image_span(handle, piece.grid_thw, position)
            position += handle.position_rule.image_slots(piece.grid_thw) + 2
        else:
            pos = torch.arange(position, position + piece.length, dtype=torch.long).expand(3, -1).clone()
            position += piece.length
        positions.append(pos)
    return positions, position


def turn_messages(conversation: Conversation, question: str | None, history_start: int = 0) -> list[Message]:
    """The messages a turn renders: the conversation's from ``history_start`` on (pinned ones kept), and
    ``question`` (if given) joined to the last message when it is the user's, else as a new user message (its
    item id ``QUESTION_ITEM_ID``). Changes nothing."""
    messages = conversation.prompt_messages(history_start)
    if question is not None:
        item = TextItem(question, QUESTION_ITEM_ID)
        if messages and messages[-1].role == "user":
            messages[-1] = Message("user", (*messages[-1].items, item))
        else:
            messages.append(Message("user", (item,)))
    return messages


@dataclass(frozen=True)
class SegmentAnchor:
    """A precompiled text segment whose exact tokens the prompt holds (so its KV can be spliced there)."""

    begin: int  # prompt index of its first token
    segment: KVSegment  # the precompiled KV (positions as compiled)
    seam: int  # leading tokens to recompute in context

    @property
    def end(self) -> int:
        """Prompt index after its last token."""
        return self.begin + self.segment.length


@dataclass(frozen=True, eq=False)
class PromptLayout:
    """One turn's prompt: what ``lay_out`` made of a conversation. Immutable."""

    token_ids: torch.Tensor  # (L,) long, exactly the processor's ids
    positions: torch.Tensor  # (3, L) long M-RoPE position ids
    pieces: tuple[PromptPiece, ...]  # text runs and images, in order, tiling [0, L)
    image_order: tuple[int, ...]  # conversation image index of each prompt image, in prompt order
    item_spans: dict[int, tuple[int, int]] | None  # text item_id -> token span (None when not traced)
    field_spans: dict[str, tuple[int, int]] | None  # field name -> token span of its value (None likewise)
    segments: tuple[SegmentAnchor, ...] = ()  # precompiled segments placed (traced layouts only)
    image_digests: tuple[
        str, ...
    ] = ()  # content digest of each prompt image, in prompt order (the pads of two
    # images of one grid have the same ids and positions: only the digest tells them apart)

    def __post_init__(self) -> None:
        n = int(self.token_ids.shape[0])
        assert self.positions.shape == (3, n), "positions must be (3, L)"
        assert (self.pieces[-1].end if self.pieces else 0) == n, "pieces must tile the prompt"

    @property
    def num_tokens(self) -> int:
        """Tokens in the prompt."""
        return int(self.token_ids.shape[0])

    @property
    def num_positions(self) -> int:
        """Position slots the prompt occupies (its largest position + 1; 0 when empty)."""
        return int(self.positions.max()) + 1 if self.num_tokens else 0

    def ids_of(self, piece: PromptPiece) -> torch.Tensor:
        """``(length,)``: the ids of one of this layout's pieces (a view)."""
        return self.token_ids[piece.begin : piece.end]

    def digest_of(self, piece: PromptPiece) -> str:
        """The content digest of an image piece's image."""
        return self.image_digests[piece.prompt_image]

    def image_of(self, piece: PromptPiece) -> int:
        """The conversation image index of an image piece."""
        assert piece.kind == "image" and piece.prompt_image is not None
        return self.image_order[piece.prompt_image]


def check_tool_support(handle: ModelHandle, conversation: Conversation) -> None:
    """Raise ``UnsupportedInputError`` when ``conversation`` declares tools or holds tool calls or results and
    the model's family has no tool-call format mmkv reads (``Family.tool_format``); changes nothing."""
    if handle.family.tool_format is None and conversation.uses_tools:
        raise UnsupportedInputError(
            f"{handle.family.label} checkpoints: mmkv does not read this family's tool-call format yet, so it "
            f"cannot take tools, tool calls or tool messages; send the conversation without them"
        )
