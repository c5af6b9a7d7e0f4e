"""``repair_plan``: which spliced tokens a turn recomputes in context beyond the seam (``TurnPolicy.repair`` and
``budget``), as a new ``Plan``; and ``repair_stats``, what a turn's plan recomputed of the KV it placed.

A spliced segment (an image's KV from the store, a precompiled text, text cut off the live cache) keeps the
attention it took where it was computed. The seam rule (``mmkv.runtime.plan``) recomputes its first tokens; a
repair recomputes ``ceil(budget * n)`` more of the ``n`` tokens each segment still splices, chosen by:

- ``"seam"``: the leading ones (no pass: a longer seam);
- ``"deviation"`` (CacheBlend): the first layers run over the prompt from the kept prefix to the last splice, in
  context, on a scratch cache (``LiveCache.layer_prefix``); a token scores how far its keys and values moved
  from the spliced (re-rotated) ones (``mmkv.runtime.ranking``). The pass needs the vision outputs of every
  image pad in that range (the encoder store, else the tower: ``ImageReuse.encoder`` says);
- ``"attention"``: the prompt's last text tokens (at most ``PROBE_TOKENS``, after the last splice) run as queries
  over the kept prefix and the splices, every layer, on a copy of the live prefix (``LiveCache.copy_prefix``, the
  eager variant via ``LiveCache.probe``); a token scores the attention it receives, averaged over layers, heads
  and queries. The computed tokens between splices are not in the probe (an approximation of the ranking only).

The scores are ``mmkv.runtime.ranking``'s, shared with the selective field edit.

The chosen tokens are then computed in context by ``execute`` like any other (exact where the context is the one
the segment was computed in: any choice is then exact). Nothing here changes the live cache. Example, an image
``[3, 69)`` spliced with seam 1 and budget 0.05 by deviation::

    seam plan:  computed (3, 1)  spliced [4, 69)                     65 spliced, ceil(3.25) = 4 chosen
    repaired:   computed (3, 1) (17, 1) (40, 2) (61, 1)  spliced [4, 17) [18, 40) [42, 61) [62, 69)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..messages import ConversationImage
from ..model.handle import ModelHandle
from ..prompt.layout import PromptLayout
from .execute import attention_mask, place_splices, resolve_features
from .live import LiveCache
from .plan import Plan, Splice, pad_features
from .ranking import (
    PROBE_TOKENS,
    deviation_depth,
    kv_deviation,
    received_attention,
    recompute_first_layers,
    top_k,
)
from .report import RepairStats
from .stores import TurnStores

__all__ = ["choose", "recompute_within", "repair_plan", "repair_stats"]


def repair_plan(
    handle: ModelHandle,
    live: LiveCache,
    plan: Plan,
    layout: PromptLayout,
    images: Sequence[ConversationImage],
    turn_stores: TurnStores,
) -> tuple[Plan, RepairStats]:
    """``plan`` (a turn's seam plan, for ``live`` holding its kept prefix) with the budget's share of each placed
    segment's spliced tokens computed instead, chosen by ``plan.policy.repair``; and what it recomputed and cost.
    With nothing to choose (budget 0, no splices) ``plan`` itself comes back, unchanged. Reads ``live`` only;
    may run the vision tower for images whose outputs the ranking needs (memoised in ``turn_stores``)."""
    policy = plan.policy
    started = time.perf_counter()
    groups = _spliced_groups(plan)
    counts = [policy.num_chosen(int(group.numel())) for group in groups]
    if not sum(counts):
        return plan, repair_stats(plan, layout)
    needed: set[int] = set()  # conversation images whose vision outputs the repair resolved
    pass_tokens = pass_layers = 0
    scores = None
    if policy.repair == "deviation":
        scores, pass_tokens, pass_layers, needed = _deviation_scores(
            handle, live, plan, layout, images, turn_stores
        )
    elif policy.repair == "attention":
        scores, pass_tokens, pass_layers = _attention_scores(handle, live, plan, layout)
    chosen = choose(groups, counts, scores)
    repaired = recompute_within(plan, layout, chosen)
    needed |= {s.image_index for s in repaired.features}
    reuse = tuple(
        replace(r, encoder=turn_stores.encoder_tier(images[r.index]))
        if r.index in needed and r.encoder is None and r.source not in ("live", "computed")
        else r
        for r in repaired.images
    )
    repaired = replace(repaired, images=reuse)
    stats = repair_stats(
        repaired, layout, len(chosen), pass_tokens, pass_layers, time.perf_counter() - started
    )
    return repaired, stats


def choose(groups: Sequence[torch.Tensor], counts: Sequence[int], scores: torch.Tensor | None) -> list[int]:
    """The prompt indices chosen: from each group (a segment's spliced indices, ascending) its ``count`` highest
    by ``scores`` (a ``(num_tokens,)`` tensor; ties to the earlier token), or its leading ``count`` when ``scores``
    is None. Ascending.

    >>> choose([torch.tensor([4, 5, 6, 7])], [2], torch.tensor([0, 0, 0, 0, 1.0, 3.0, 0.5, 3.0]))
    [5, 7]
    """
    out: list[int] = []
    for group, count in zip(groups, counts, strict=True):
        if not count:
            continue
        picked = range(count) if scores is None else top_k(scores[group], count)
        out += group[list(picked)].tolist()
    return sorted(out)


def recompute_within(plan: Plan, layout: PromptLayout, chosen: Sequence[int]) -> Plan:
    """``plan`` with the spliced prompt indices ``chosen`` computed instead: their splices split around them, the
    computed runs merged, the vision-output slices redrawn for every computed pad. Pure; ``ValueError`` for an
    index that ``plan`` does not splice."""
    chosen = sorted({int(i) for i in chosen})
    splices: list[Splice] = []
    at = 0
    for splice in plan.splices:
        cursor = splice.start
        while at < len(chosen) and chosen[at] < splice.end:
            index = chosen[at]
            if index < cursor:
                raise ValueError(f"prompt index {index} is not spliced by the plan")
            if index > cursor:
                splices.append(
                    Splice(cursor, splice.segment.slice(cursor - splice.start, index - splice.start))
                )
            cursor, at = index + 1, at + 1
        if cursor < splice.end:
            splices.append(Splice(cursor, splice.segment.slice(cursor - splice.start)))
    if at < len(chosen):
        raise ValueError(f"prompt index {chosen[at]} is not spliced by the plan")
    computed = _merge([*plan.computed, *((i, 1) for i in chosen)])
    features = tuple(pad_features(layout, computed))
    return replace(plan, splices=tuple(splices), computed=computed, features=features)


def repair_stats(
    plan: Plan,
    layout: PromptLayout,
    chosen: int = 0,
    pass_tokens: int = 0,
    pass_layers: int = 0,
    seconds: float = 0.0,
) -> RepairStats:
    """What ``plan`` recomputes of the segments it places (``chosen`` of them by a repair; the pass's size and
    the time are the caller's). Pure."""
    policy = plan.policy
    base = RepairStats(policy.repair, policy.repair_budget)
    if not plan.placed:
        return base
    image_begins = {p.begin for p in layout.pieces if p.kind == "image"}
    placed = recomputed = image_tokens = image_recomputed = 0
    for start, length in plan.placed:
        inside = _overlap(start, start + length, plan.computed)
        placed, recomputed = placed + length, recomputed + inside
        if start in image_begins:
            image_tokens, image_recomputed = image_tokens + length, image_recomputed + inside
    return replace(
        base, placed=placed, recomputed=recomputed, chosen=chosen, image_tokens=image_tokens,
        image_recomputed=image_recomputed, pass_tokens=pass_tokens, pass_layers=pass_layers, seconds=seconds,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ rankings
def _deviation_scores(handle, live, plan, layout, images, turn_stores):
    """``(num_tokens,)`` scores (layer-1 K and V deviation norms, summed; spliced indices only), the pass's tokens
    and layers, and the images whose vision outputs the pass used."""
    keep, end = plan.keep, max(splice.end for splice in plan.splices)
    depth = deviation_depth(handle)
    scratch = live.layer_prefix(keep, depth) if keep else None  # copies: the live cache is not touched
    slices = pad_features(layout, [(keep, end - keep)])
    features = resolve_features(slices, images, turn_stores)
    positions = layout.positions
    keys, values = recompute_first_layers(
        handle, scratch, layout.token_ids[keep:end], positions[:, keep:end], features
    )  # (kv_heads, end, D) each, by prompt index
    layer = depth - 1
    one_layer = [
        Splice(s.start, replace(s.segment, keys=s.segment.keys[layer : layer + 1], values=s.segment.values[layer : layer + 1]))
        for s in plan.splices
    ]  # fmt: skip
    cached = place_splices(one_layer, positions, plan.policy)  # (1, 1, kv_heads, S, D), re-rotated
    spliced = _spliced_indices(plan)  # (S,)
    index = spliced.to(keys.device)
    scores = torch.full((layout.num_tokens,), float("-inf"))
    scores[spliced] = kv_deviation(keys[:, index], values[:, index], cached.keys[0, 0], cached.values[0, 0])
    return scores, end - keep, depth, {s.image_index for s in slices}


def _attention_scores(handle, live, plan, layout):
    """``(num_tokens,)`` scores (mean attention received from the probe's queries over layers and heads; spliced
    indices only), the probe's tokens and layers."""
    keep = plan.keep
    last_end = max(splice.end for splice in plan.splices)
    computed = plan.computed_indices()
    tail = computed[computed >= last_end]
    tail = tail[
        layout.token_ids[tail] != handle.processor.image_token_id
    ]  # text only: the probe takes no pixels
    queries = tail[-PROBE_TOKENS:]  # (Q,)
    assert queries.numel(), "a turn's last token is text and computed"
    spliced = _spliced_indices(plan)
    probe = (
        live.copy_prefix(keep) if keep else LiveCache(handle)
    )  # views of the live prefix: it is not touched
    probe.append_spliced(place_splices(plan.splices, layout.positions, plan.policy))
    entries = torch.cat(
        [torch.arange(keep), spliced, queries]
    )  # prompt index of every entry during the probe
    mask = attention_mask(entries, queries, handle.dtype).to(handle.device)
    result = probe.probe(layout.token_ids[queries], layout.positions[:, queries], mask)
    weights = received_attention(result.attentions)  # (K,)
    scores = torch.full((layout.num_tokens,), float("-inf"))
    scores[spliced] = weights[keep : keep + spliced.numel()]
    return scores, int(queries.numel()), handle.num_layers


# ------------------------------------------------------------------------------------------------- helpers
def _spliced_indices(plan: Plan) -> torch.Tensor:
    """``(S,)`` long: the prompt indices ``plan`` splices, in splice order (ascending)."""
    return torch.cat([torch.arange(s.start, s.end) for s in plan.splices])


def _spliced_groups(plan: Plan) -> list[torch.Tensor]:
    """The spliced prompt indices of each placed segment, ascending (empty where a segment splices none)."""
    if not plan.splices:
        return []
    spliced = _spliced_indices(plan)
    return [spliced[(spliced >= start) & (spliced < start + length)] for start, length in plan.placed]


def _overlap(begin: int, end: int, runs: Sequence[tuple[int, int]]) -> int:
    """Tokens of ``[begin, end)`` covered by ``runs`` ((start, length), disjoint)."""
    return sum(max(0, min(end, s + n) - max(begin, s)) for s, n in runs)


def _merge(runs: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Disjoint ``(start, length)`` runs sorted, adjacent ones joined.

    >>> _merge([(5, 1), (0, 3), (3, 1)])
    ((0, 4), (5, 1))
    """
    out: list[tuple[int, int]] = []
    for start, length in sorted(runs):
        if out and sum(out[-1]) == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            assert not out or sum(out[-1]) < start, "computed runs overlap"
            out.append((start, length))
    return tuple(out)
