"""``Plan``: how one prompt's KV is brought into the live cache, as data. ``plan_turn`` / ``plan_replace`` make
one without touching the live cache or the model (the store lookups they ask ``turn_stores`` for are the only reads).

A plan says, for every prompt token after the kept live prefix, whether its KV is **spliced** (a cached segment
placed, re-rotated, at its new positions) or **computed** (run through the model in context), which vision
outputs the computed image pads take, which image KV to store afterwards, and where each image came from. The
pieces tile the prompt exactly; ``Plan.__post_init__`` checks it. Example, a prompt of 12 tokens whose first 3
are live, an image ``[3, 11)`` hit in the store with seam 1, and one text token::

    keep 3 | computed (3, 1)  spliced [4, 11) from the store  computed (11, 1)
    images: (index 0, "memory"); features: none (seam 1 is the <|vision_start|> marker alone)

Rules kept in one place: the seam (``_plan_seamed``: the first ``seam`` tokens of a spliced segment are
computed; for an image they are its start marker and first pads) and, for a turn, the prompt's last token is
always computed (``_compute_last``: its logits are the answer's first). Every cached segment placed is listed in
``Plan.placed`` (the image above: ``((3, 8),)``); the policy's repair beyond the seam (``TurnPolicy.repair`` and
``budget``) computes more of them, chosen by ``mmkv.runtime.repair``. The policy itself lives in
``mmkv.policy``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from ..cache.store import StoreTier
from ..errors import StoreMismatchError
from ..kv.segment import KVSegment
from ..messages import ConversationImage
from ..policy import TurnPolicy
from ..prompt.layout import PromptLayout

__all__ = [
    "FeatureSlice",
    "ImageReuse",
    "Plan",
    "KVOrigin",
    "StoreLookups",
    "Splice",
    "StoreWrite",
    "plan_replace",
    "plan_turn",
]

KVOrigin = Literal["live", "computed"] | StoreTier  # where an image's KV came from


@dataclass(frozen=True)
class ImageReuse:
    """Where one image of a turn came from."""

    index: int  # the image's number in the conversation (0-based, in order of add_image)
    digest: str  # its content digest
    source: KVOrigin  # where its language-model KV came from: "live" (kept prefix), "memory"/"disk" (a KV
    # store tier: spliced), "computed" (prefilled this turn)
    encoder: str | None = None  # where its vision outputs came from when the turn needed them: "memory" /
    # "disk" (encoder store), "computed" (the vision tower ran); None when not needed (KV live or fully spliced)

    @property
    def reused_from(self) -> str:
        """The tier of the cached work this image used: its KV's source unless computed, else its vision
        outputs' (``"computed"`` when neither was cached)."""
        return self.source if self.source != "computed" else (self.encoder or "computed")


@dataclass(frozen=True)
class Splice:
    """A cached segment placed at prompt indices ``[start, start + length)``."""

    start: int  # prompt index of its first token
    segment: KVSegment  # the KV, at the positions it was computed at (moved to the prompt's at execution)

    @property
    def end(self) -> int:
        """Prompt index after its last token."""
        return self.start + self.segment.length


@dataclass(frozen=True)
class FeatureSlice:
    """Vision-output rows of one image that computed pads take, in order."""

    image_index: int  # conversation image index
    rows: Sequence[int]  # which pads of the image (a range for a contiguous run)


@dataclass(frozen=True)
class StoreWrite:
    """Image KV to store once the turn has computed it."""

    start: int  # prompt index of the image's <|vision_start|>
    length: int  # tokens of the image span (markers included)
    digest: str  # the key


@dataclass(frozen=True)
class Plan:
    """How the prompt's tokens get their KV. Validated: keep + splices + computed tile ``[0, num_tokens)``."""

    num_tokens: int  # tokens in the prompt
    keep: int  # live entries kept as they are: prompt indices [0, keep)
    splices: tuple[Splice, ...]  # cached segments placed after the kept prefix, ascending
    computed: tuple[tuple[int, int], ...]  # (start, length) runs run through the model, ascending, merged
    features: tuple[FeatureSlice, ...]  # vision outputs of the computed pads, in prompt order
    writes: tuple[StoreWrite, ...] = ()  # image KV to store afterwards
    images: tuple[ImageReuse, ...] = ()  # where each image of the prompt came from, in prompt order
    policy: TurnPolicy = field(default_factory=TurnPolicy)  # rotation settings for the splices
    logits_at_end: bool = True  # a turn: the last token is computed (its logits answer); False for edits
    placed: tuple[tuple[int, int], ...] = ()  # (start, length) of each cached segment placed at new positions
    # (seam included), ascending: store-hit images, precompiled text, cut-off live text (what a repair works on)

    def __post_init__(self) -> None:
        covered = [(0, self.keep)] if self.keep else []
        covered += [(s.start, s.end) for s in self.splices] + [(s, s + n) for s, n in self.computed]
        covered.sort()
        cursor = 0
        for begin, end in covered:
            if begin != cursor or end <= begin:
                raise ValueError(f"plan does not tile the prompt: gap or overlap at {cursor} ({covered})")
            cursor = end
        if cursor != self.num_tokens:
            raise ValueError(f"plan covers {cursor} of {self.num_tokens} tokens")
        if not self.computed:
            raise ValueError("a plan computes at least one token")
        if self.logits_at_end and sum(self.computed[-1]) != self.num_tokens:
            raise ValueError("the prompt's last token must be computed")
        if any(s < self.keep or s + n > self.num_tokens or n <= 0 for s, n in self.placed):
            raise ValueError(f"placed segments {self.placed} must lie after the kept prefix, in the prompt")

    @property
    def prefilled(self) -> int:
        """Tokens run through the language model."""
        return sum(n for _, n in self.computed)

    @property
    def reused(self) -> int:
        """Tokens whose KV came from the live cache or a store."""
        return self.num_tokens - self.prefilled

    def computed_indices(self) -> torch.Tensor:
        """``(Q,)`` long: the prompt indices computed, ascending."""
        return torch.cat([torch.arange(s, s + n) for s, n in self.computed])


class StoreLookups(Protocol):
    """What the planner asks about images (``mmkv.runtime.stores.TurnStores`` in a session)."""

    def kv(self, image: ConversationImage) -> tuple[KVSegment | None, str | None]: ...

    def encoder_tier(self, image: ConversationImage) -> str: ...


@dataclass
class _Builder:
    """A plan being made (mutable), frozen by ``build``."""

    num_tokens: int
    keep: int
    splices: list[Splice] = field(default_factory=list)
    computed: list[tuple[int, int]] = field(default_factory=list)
    features: list[FeatureSlice] = field(default_factory=list)
    writes: list[StoreWrite] = field(default_factory=list)
    images: list[ImageReuse] = field(default_factory=list)
    placed: list[tuple[int, int]] = field(default_factory=list)

    def splice(self, start: int, segment: KVSegment) -> None:
        self.splices.append(Splice(start, segment))

    def compute(self, start: int, length: int) -> None:
        """Compute ``length`` tokens from ``start`` (merged with the previous run when adjacent)."""
        if self.computed and sum(self.computed[-1]) == start:
            self.computed[-1] = (self.computed[-1][0], self.computed[-1][1] + length)
        else:
            self.computed.append((start, length))

    def build(self, policy: TurnPolicy, logits_at_end: bool) -> Plan:
        return Plan(
            self.num_tokens,
            self.keep,
            tuple(self.splices),
            tuple(self.computed),
            tuple(self.features),
            tuple(self.writes),
            tuple(self.images),
            policy,
            logits_at_end,
            tuple(self.placed),
        )


def plan_turn(
    layout: PromptLayout,
    images: Sequence[ConversationImage],
    keep: int,
    policy: TurnPolicy,
    turn_stores: StoreLookups,
    reusable_text: Sequence[KVSegment] = (),
) -> Plan:
    """The plan that brings a live cache holding ``layout``'s first ``keep`` tokens to the whole prompt.

    Images past the prefix: under ``kv`` a store hit is spliced (seam computed), a miss computed and stored;
    under ``encoder``/``none`` computed (from cached or fresh vision outputs, as ``turn_stores`` says). Text runs
    are computed, except under ``kv``: precompiled segments the layout places are spliced (seam computed), and
    a run that begins with one of ``reusable_text`` (text cut off the live cache, e.g. after an image left the
    window) is spliced from it. The last token is always computed. ``images`` are the conversation's.
    No side effects (``reusable_text`` is not changed); raises ``StoreMismatchError`` for a stored segment
    whose tokens are not the image's.
    """
    ids = layout.token_ids
    builder = _Builder(layout.num_tokens, keep)
    candidates = list(reusable_text) if policy.splices_kv else []
    anchors = layout.segments if policy.splices_kv else ()
    first = bisect.bisect_right(layout.pieces, keep, key=lambda piece: piece.end)  # pieces wholly kept
    live_images = next(
        (p.prompt_image for p in layout.pieces[first:] if p.kind == "image"), len(layout.image_order)
    )
    for index in layout.image_order[:live_images]:
        builder.images.append(ImageReuse(index, images[index].digest, "live"))
    for piece in layout.pieces[first:]:
        start = max(piece.begin, keep)
        if piece.kind == "image":
            assert start == piece.begin, "the kept prefix ends inside an image"
            _plan_image(
                builder,
                piece.begin,
                ids[piece.begin : piece.end],
                layout.image_of(piece),
                images,
                policy,
                turn_stores,
            )
            continue
        for anchor in anchors:  # precompiled segments inside this run
            if start <= anchor.begin and anchor.end <= piece.end:
                _plan_text(builder, start, ids[start : anchor.begin], candidates)
                _plan_seamed(builder, anchor.begin, anchor.segment, anchor.seam)
                start = anchor.end
        _plan_text(builder, start, ids[start : piece.end], candidates)
    _compute_last(builder)
    return builder.build(policy, logits_at_end=True)


def plan_replace(
    layout: PromptLayout,
    begin: int,
    old_end: int,
    new_end: int,
    downstream: KVSegment | None,
    extra: Sequence[int] = (),
    policy: TurnPolicy | None = None,
) -> Plan:
    """The plan of an edit: keep ``[0, begin)``, compute ``[begin, new_end)`` and the prompt indices ``extra``
    (all ``>= new_end``), and splice ``downstream`` (the old live entries from ``old_end`` on) for everything
    else after ``new_end``: it moves by ``new_end - old_end`` (re-rotated; content not updated). Computed image
    pads take their vision-output rows. No side effects; ``ValueError`` for spans that do not fit."""
    n = layout.num_tokens
    downstream_len = 0 if downstream is None else downstream.length
    if n - new_end != downstream_len or not 0 <= begin < new_end:
        raise ValueError("plan_replace: the spans do not match the live cache and the rendering")
    builder = _Builder(n, begin)
    builder.compute(begin, new_end - begin)
    cursor = new_end
    for index in sorted(set(extra)):
        if not new_end <= index < n:
            raise ValueError(f"plan_replace: extra index {index} is outside [{new_end}, {n})")
        if index > cursor:
            builder.splice(cursor, downstream.slice(cursor - new_end, index - new_end))
        builder.compute(index, 1)
        cursor = index + 1
    if cursor < n:
        builder.splice(cursor, downstream.slice(cursor - new_end))
    builder.features = pad_features(layout, builder.computed)
    return builder.build(policy or TurnPolicy(), logits_at_end=False)


def pad_features(layout: PromptLayout, computed: Sequence[tuple[int, int]]) -> list[FeatureSlice]:
    """The vision-output rows each image's computed pads take, for ``computed`` (start, length) runs."""
    indices = torch.cat([torch.arange(s, s + n) for s, n in computed]) if computed else torch.zeros(0)
    out = []
    for piece in layout.pieces:
        if piece.kind != "image":
            continue
        inside = indices[(indices > piece.begin) & (indices < piece.end - 1)]  # pads only, not the markers
        if inside.numel():
            rows = (inside - piece.begin - 1).tolist()
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            out.append(
                FeatureSlice(
                    layout.image_of(piece), range(rows[0], rows[0] + len(rows)) if contiguous else tuple(rows)
                )
            )
    return out


def _plan_text(builder: _Builder, start: int, ids: torch.Tensor, candidates: list[KVSegment]) -> None:
    """A text run: splice the longest cut-off live text segment it begins with, as long as one matches
    (consuming it), then compute the rest."""
    while ids.shape[0] and candidates:
        match = max(
            (c for c in candidates if c.length <= ids.shape[0] and torch.equal(c.token_ids, ids[: c.length])),
            key=lambda c: c.length,
            default=None,
        )
        if match is None:
            break
        candidates.remove(match)
        builder.splice(start, match)
        builder.placed.append((start, match.length))
        start, ids = start + match.length, ids[match.length :]
    if ids.shape[0]:
        builder.compute(start, int(ids.shape[0]))


def _plan_seamed(builder: _Builder, start: int, segment: KVSegment, seam: int) -> None:
    """The seam rule: the first ``seam`` tokens of a spliced segment are computed in context, the rest spliced."""
    seam = min(seam, segment.length)
    builder.placed.append((start, segment.length))
    if seam:
        builder.compute(start, seam)
    if seam < segment.length:
        builder.splice(start + seam, segment.slice(seam))


def _plan_image(
    builder: _Builder,
    start: int,
    span_ids: torch.Tensor,
    index: int,
    images: Sequence[ConversationImage],
    policy: TurnPolicy,
    turn_stores: StoreLookups,
) -> None:
    """An image: under ``kv`` its stored KV spliced (seam computed from its vision outputs); otherwise (or on a
    miss) computed from cached or fresh vision outputs, and under ``kv`` stored afterwards."""
    image, length = images[index], int(span_ids.shape[0])
    num_pads = length - 2  # between <|vision_start|> and <|vision_end|>
    if policy.splices_kv:
        segment, tier = turn_stores.kv(image)
        if segment is not None:
            if not torch.equal(segment.token_ids.cpu(), span_ids.cpu()):
                raise StoreMismatchError("the stored KV is for other tokens than this image's span")
            seam_pads = min(max(policy.seam - 1, 0), num_pads)  # the seam's first token is <|vision_start|>
            encoder = turn_stores.encoder_tier(image) if seam_pads else None
            builder.images.append(ImageReuse(index, image.digest, tier, encoder))
            if seam_pads:
                builder.features.append(FeatureSlice(index, range(seam_pads)))
            _plan_seamed(builder, start, segment, policy.seam)
            return
    builder.images.append(ImageReuse(index, image.digest, "computed", turn_stores.encoder_tier(image)))
    builder.features.append(FeatureSlice(index, range(num_pads)))
    builder.compute(start, length)
    if policy.splices_kv:
        builder.writes.append(StoreWrite(start, length, image.digest))


def _compute_last(builder: _Builder) -> None:
    """The last-token rule: if a splice covers the prompt's last token, that token is computed instead."""
    last = builder.num_tokens - 1
    if (
        builder.splices
        and builder.splices[-1].end == builder.num_tokens
        and builder.splices[-1].start <= last
    ):
        tail = builder.splices.pop()
        if tail.segment.length > 1:
            builder.splices.append(Splice(tail.start, tail.segment.slice(0, tail.segment.length - 1)))
        builder.compute(last, 1)
