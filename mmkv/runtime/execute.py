"""``execute``: carry out a ``Plan`` on a ``LiveCache`` in one forward call.

1. every spliced segment is moved to its prompt positions (re-rotated, exact) and appended to the cache;
2. every token to compute runs in **one** ``prefill_span`` call, under an attention mask that lets each see
   exactly the entries that precede it in the prompt (``attention_mask``: the one mask builder);
3. the cache's new entries are put back in prompt order, and the live cache records the prompt.

Example, keep 3, a splice at [4, 11) and computed tokens 3 and 11: the cache holds entries for prompt indices
``[0 1 2 | 4 5 6 7 8 9 10 | 3 11]`` during the call, token 3 sees ``0 1 2`` and itself, token 11 sees all;
afterwards the entries are ``0 .. 11`` in order.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import TypeVar

import torch

from ..kv.segment import KVSegment
from ..kv.vision import ImageFeatures
from ..messages import ConversationImage
from ..model.handle import ModelHandle
from ..mrope import rerotate
from ..policy import TurnPolicy
from ..prompt.layout import PromptLayout
from .live import LiveCache
from .plan import FeatureSlice, Plan, Splice, plan_replace
from .stores import TurnStores

T = TypeVar("T")

__all__ = [
    "MASK_ELEMENTS",
    "attention_mask",
    "drain",
    "execute",
    "execute_steps",
    "place_splices",
    "replace_span",
    "resolve_features",
]


def attention_mask(entry_index: torch.Tensor, query_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(1, 1, Q, K)`` mask: query ``q`` (prompt index ``query_index[q]``) sees cache entry ``k`` iff
    ``entry_index[k] <= query_index[q]``. ``dtype=torch.bool``: True = attend (sdpa); a float dtype: additive,
    0 = attend, the dtype's min = not (eager attention adds it).

    >>> attention_mask(torch.tensor([0, 2, 1]), torch.tensor([1]), torch.bool).tolist()
    [[[[True, False, True]]]]
    """
    visible = entry_index[None, :] <= query_index[:, None]  # (Q, K)
    if dtype == torch.bool:
        return visible[None, None]  # (1, 1, Q, K)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]  # (1, 1, Q, K)


def resolve_features(
    slices: Sequence[FeatureSlice], images: Sequence[ConversationImage], turn_stores: TurnStores
) -> list[ImageFeatures]:
    """The vision outputs ``slices`` name (from ``turn_stores``: memo, store or tower), in order."""
    out = []
    for feature_slice in slices:
        full = turn_stores.features(images[feature_slice.image_index])[0]
        rows = feature_slice.rows
        if isinstance(rows, range) and rows == range(full.num_pads):
            out.append(full)
            continue
        if isinstance(rows, range) and rows.step == 1:
            out.append(
                ImageFeatures(
                    full.embeds[rows.start : rows.stop],
                    tuple(d[rows.start : rows.stop] for d in full.deepstack),
                )
            )
            continue
        index = torch.tensor(list(rows), device=full.embeds.device)
        out.append(ImageFeatures(full.embeds[index], tuple(d[index] for d in full.deepstack)))
    return out


def execute(
    handle: ModelHandle,
    live: LiveCache,
    plan: Plan,
    layout: PromptLayout,
    images: Sequence[ConversationImage],
    turn_stores: TurnStores,
) -> torch.Tensor:
    """Bring ``live`` (holding exactly ``plan.keep`` entries of ``layout``) to the whole prompt in one go (see
    ``execute_steps``); returns the ``(vocab,)`` float32 logits after the last computed token. Mutates ``live``."""
    return drain(execute_steps(handle, live, plan, layout, images, turn_stores))


def execute_steps(
    handle: ModelHandle,
    live: LiveCache,
    plan: Plan,
    layout: PromptLayout,
    images: Sequence[ConversationImage],
    turn_stores: TurnStores,
    chunk_tokens: int | None = None,
) -> Generator[None, None, torch.Tensor]:
    """Bring ``live`` (holding exactly ``plan.keep`` entries of ``layout``) to the whole prompt; a generator that
    yields after each forward call and returns the ``(vocab,)`` float32 logits (on the model's device) after the
    last computed token. Mutates ``live`` (cache and record); on an exception the live cache is in an undefined
    state (reset it).

    ``chunk_tokens``: at most that many tokens per forward call (an engine runs other sequences' decode steps
    between the chunks); None: as few calls as memory allows. The chunking depends on the plan only, never on
    what else runs, so a prompt is computed the same way whatever the load.

    Memory stays bounded: when the one call's mask would exceed ``MASK_ELEMENTS`` entries (or the computed
    tokens exceed ``chunk_tokens``), the computed tokens before the last splice run in masked chunks of bounded
    size, the cache is put in prompt order, and the rest (the computed tail, usually the bulk of new text) runs
    on the model's own causal path, with no mask at all: so a splice never costs more attention memory than
    recomputing."""
    if live.num_tokens != plan.keep:
        raise ValueError(f"the live cache holds {live.num_tokens} entries; the plan keeps {plan.keep}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens!r}")
    ids = layout.token_ids
    entry_index = [torch.arange(plan.keep)]  # prompt index of every cache entry, in cache order
    if plan.splices:
        live.append_spliced(place_splices(plan.splices, layout.positions, plan.policy))
        entry_index += [torch.arange(splice.start, splice.end) for splice in plan.splices]
    computed = plan.computed_indices()  # (Q,)
    features = resolve_features(plan.features, images, turn_stores)
    entries = torch.cat(entry_index)  # (keep + spliced,)
    fits = chunk_tokens is None or computed.numel() <= chunk_tokens
    if not plan.splices:
        logits = yield from _run_causal(handle, live, layout, computed, features, chunk_tokens)
    elif fits and computed.numel() * (entries.numel() + computed.numel()) <= MASK_ELEMENTS:
        logits = _run(handle, live, layout, computed, features, torch.cat([entries, computed]))
        live.reorder_tail(plan.keep, torch.argsort(torch.cat([entries, computed])[plan.keep :]))
    else:
        last_splice_end = max(splice.end for splice in plan.splices)
        head, tail = computed[computed < last_splice_end], computed[computed >= last_splice_end]
        chunk = max(1, MASK_ELEMENTS // (entries.numel() + head.numel()))
        chunk = chunk if chunk_tokens is None else min(chunk, chunk_tokens)
        logits = None
        for begin in range(0, head.numel(), chunk):
            part = head[begin : begin + chunk]
            taken, features = _take_features(features, _num_pads(handle, ids[part]))
            entries = torch.cat([entries, part])
            logits = _run(handle, live, layout, part, taken, entries)
            yield
        live.reorder_tail(plan.keep, torch.argsort(entries[plan.keep :]))
        if tail.numel():
            logits = yield from _run_causal(handle, live, layout, tail, features, chunk_tokens)
    live.mark_prompt(layout)
    return logits


def drain(steps: Generator[None, None, T]) -> T:
    """Run a step generator (``execute_steps``, ``turn_steps``) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _num_pads(handle: ModelHandle, token_ids: torch.Tensor) -> int:
    return int((token_ids == handle.processor.image_token_id).sum())


def _run_causal(
    handle, live, layout, computed, features, chunk_tokens
) -> Generator[None, None, torch.Tensor]:
    """Contiguous prompt indices ``computed`` on the causal path, ``chunk_tokens`` at a time (None: at once),
    yielding after each call but the last; the last call's logits."""
    size = computed.numel() if chunk_tokens is None else chunk_tokens
    logits = None
    for begin in range(0, computed.numel(), size):
        if logits is not None:
            yield
        part = computed[begin : begin + size]
        taken, features = _take_features(features, _num_pads(handle, layout.token_ids[part]))
        logits = _run(handle, live, layout, part, taken, None)
    return logits


def place_splices(splices: Sequence[Splice], positions: torch.Tensor, policy: TurnPolicy) -> KVSegment:
    """All ``splices`` as one segment, in order, each token re-rotated from where it was computed to its
    prompt position (one ``rerotate`` call for all of them; the no-rotation control only relabels positions).
    Changes nothing."""
    joined = splices[0].segment if len(splices) == 1 else KVSegment.concat([s.segment for s in splices])
    target = torch.cat([positions[:, s.start : s.end] for s in splices], dim=1)  # (3, S)
    if not policy.rotate:
        return replace(joined, position_ids=target.clone())
    delta = target - joined.position_ids  # (3, S): uniform per segment under the transformers rule
    keys = rerotate(
        joined.keys, delta, joined.rotary, axes=policy.rotate_axes, from_positions=joined.position_ids
    )
    return replace(joined, keys=keys, position_ids=target.clone())


MASK_ELEMENTS = 1 << 24  # (queries x keys) entries one masked call may build: 16 MB as bool, 64 MB as float32


def _run(handle, live, layout, computed, features, entries) -> torch.Tensor:
    """One forward call over prompt indices ``computed``; with ``entries`` (the prompt index of every cache
    entry, the computed ones last) under the mask they imply, else on the causal path."""
    mask = None
    if entries is not None:
        eager = handle.model.config.get_text_config()._attn_implementation == "eager"
        mask_dtype = handle.dtype if eager else torch.bool  # eager adds the mask; sdpa takes booleans
        mask = attention_mask(entries, computed, mask_dtype).to(handle.device)
    return live.forward(layout.token_ids[computed], layout.positions[:, computed], features, mask)


def _take_features(
    features: list[ImageFeatures], num_pads: int
) -> tuple[list[ImageFeatures], list[ImageFeatures]]:
    """The first ``num_pads`` pads' vision outputs of ``features`` (in order), and the rest."""
    taken, rest = [], list(features)
    while num_pads and rest:
        first = rest.pop(0)
        if first.num_pads <= num_pads:
            taken.append(first)
            num_pads -= first.num_pads
            continue
        taken.append(ImageFeatures(first.embeds[:num_pads], tuple(d[:num_pads] for d in first.deepstack)))
        rest.insert(0, ImageFeatures(first.embeds[num_pads:], tuple(d[num_pads:] for d in first.deepstack)))
        num_pads = 0
    return taken, rest


def replace_span(
    handle: ModelHandle,
    live: LiveCache,
    layout: PromptLayout,
    images: Sequence[ConversationImage],
    turn_stores: TurnStores,
    begin: int,
    old_end: int,
    new_end: int,
    extra: Sequence[int] = (),
    policy: TurnPolicy | None = None,
) -> None:
    """Make ``live`` hold ``layout`` by recomputing only tokens ``[begin, new_end)`` and the prompt indices
    ``extra`` (all >= ``new_end``), in context; the live entries from ``old_end`` on are kept for the tokens from
    ``new_end`` on, re-rotated by ``new_end - old_end`` (their content is not updated). Mutates ``live``;
    ``ValueError`` (``live`` unchanged) when the spans do not fit it."""
    if layout.num_tokens - new_end != live.num_tokens - old_end or not 0 <= begin <= min(new_end, old_end):
        raise ValueError("replace_span: the spans do not match the live cache and the rendering")
    downstream = live.segment(old_end) if old_end < live.num_tokens else None
    plan = plan_replace(layout, begin, old_end, new_end, downstream, extra, policy)
    live.truncate(begin)
    execute(handle, live, plan, layout, images, turn_stores)
    turn_stores.flush(live, plan.writes)
