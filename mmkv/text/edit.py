"""Editing a named field of a session's context, by one of five strategies.

A field (``Session.add_text("account_role: {role}", fields={"role": "admin"})``) is a value whose tokens sit
somewhere in the live cache; what comes after it was computed seeing the old value. Strategies, cheapest
first:

- ``erratum``: leave the context alone and append one salient line announcing the new value (default
  ``DEFAULT_ERRATUM``) as a message of its own; every earlier K and V stays bit-identical;
- ``in_place``: recompute only the value's own tokens, at their positions; everything after them is kept as it
  was (stale). A value with another token count moves everything after it: those keys are re-rotated by the
  difference (exact rotation, stale content);
- ``selective``: ``in_place`` plus the ``k`` later tokens ranked highest, by the attention they receive from the
  context's last position (``rank="attention"``) or by how far their KV moves when the first layers are
  recomputed (``rank="deviation"``, the CacheBlend-style baseline): ``mmkv.runtime.ranking``'s scores, the
  same the repair beyond the seam uses;
- ``suffix``: recompute everything from the value on (exact);
- ``full``: recompute the whole context (the reference).

Every strategy reports the tokens it recomputed, their fraction of the context, and the time taken.

The strategies work on an ``EditTarget`` (a ``Session`` is one): a conversation, a live cache, a layout, and
the two cache-building calls ``prefill`` and ``replace_span``. Every cache-building path goes through
``mmkv.kv.prefill_span``: the attention ranking's one-token probe too (``LiveCache.probe``: the model's
eager-attention variant, the cache cropped back to what it held), and the deviation ranking's two-layer
recompute (``mmkv.runtime.ranking.recompute_first_layers`` over a scratch copy of the cache's first layers). The
shared model is never changed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..conversation import Conversation
from ..errors import UnsupportedInputError
from ..kv.vision import ImageFeatures
from ..model.handle import ModelHandle
from ..policy import RANKINGS, Ranking
from ..prompt.layout import PromptLayout
from ..runtime.execute import attention_mask
from ..runtime.live import LiveCache
from ..runtime.ranking import deviation_depth, kv_deviation, received_attention, recompute_first_layers, top_k
from .erratum import DEFAULT_ERRATUM, erratum_line

__all__ = ["STRATEGIES", "EditReport", "EditTarget", "edit_field"]

Strategy = Literal["erratum", "in_place", "selective", "suffix", "full"]
STRATEGIES: tuple[str, ...] = ("erratum", "in_place", "selective", "suffix", "full")


@dataclass(frozen=True)
class EditReport:
    """What one field edit did."""

    field: str  # the field's name
    old: str  # its value before
    new: str  # its value after
    strategy: str  # one of STRATEGIES
    recomputed: int  # tokens run through every layer of the language model for the edit
    context_tokens: int  # tokens in the live cache after the edit
    seconds: float  # wall time of the edit (ranking included; bringing the cache up to date first excluded)
    selected: tuple[int, ...] = ()  # selective: prompt indices of the recomputed tokens after the field

    @property
    def fraction(self) -> float:
        """Share of the context recomputed."""
        return self.recomputed / max(1, self.context_tokens)


class EditTarget(Protocol):
    """What an edit needs of its session: ``mmkv.Session`` implements it."""

    handle: ModelHandle  # the model
    live: LiveCache  # the KV held now
    conversation: Conversation  # what was said (fields included)

    def prompt_layout(
        self, question: str | None = None, add_generation_prompt: bool = True, trace: bool = False
    ) -> PromptLayout: ...

    def prefill(self, reuse: str | None = None): ...  # bring the live cache up to the conversation

    def replace_span(
        self, layout: PromptLayout, begin: int, old_end: int, new_end: int, extra: Sequence[int] = ()
    ) -> None: ...  # recompute [begin, new_end) and extra, keep the rest re-rotated

    def pad_features(self, layout: PromptLayout, indices: Sequence[int]) -> list[ImageFeatures]: ...


def edit_field(
    target: EditTarget,
    name: str,
    value: str,
    strategy: Strategy = "suffix",
    *,
    k: int = 8,
    rank: Ranking = "attention",
    erratum: str = DEFAULT_ERRATUM,
    erratum_role: str = "system",
) -> EditReport:
    """Change field ``name`` of ``target`` to ``value`` by ``strategy`` (see the module docstring).

    The live cache is first brought up to the conversation as it stands (not timed). Raises ``ValueError`` /
    ``KeyError`` / ``TypeError`` for a bad strategy, field or value, with the conversation unchanged; on a
    failure during the edit the conversation is put back and the live cache dropped.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown edit strategy {strategy!r}; choose from {STRATEGIES}")
    if rank not in RANKINGS:
        raise ValueError(f"unknown ranking {rank!r}; choose from {RANKINGS}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if not isinstance(value, str) or not value:
        raise TypeError(f"field {name!r}: the new value must be a non-empty str")
    conversation = target.conversation
    conversation.field_item(name)  # KeyError naming the known fields
    old = conversation.field_values[name]
    target.prefill()
    state = conversation.snapshot()
    started = time.perf_counter()
    try:
        if strategy == "erratum":
            conversation.add_text(erratum_line(name, value, erratum), role=erratum_role, new_message=True)
            stats = target.prefill()
            conversation.note_field_value(name, value)
            return EditReport(
                name,
                old,
                value,
                strategy,
                stats.prefilled,
                target.live.num_tokens,
                time.perf_counter() - started,
            )
        before = target.prompt_layout(None, add_generation_prompt=False, trace=True)
        conversation.set_field(name, value)
        after = target.prompt_layout(None, add_generation_prompt=False, trace=True)
        if before.field_spans is None or after.field_spans is None:
            raise UnsupportedInputError(
                "this chat template rewrites message text, so fields cannot be located"
            )
        begin, old_end, new_end = _changed_span(before, after, name)
        with torch.inference_mode():
            selected: tuple[int, ...] = ()
            if strategy in ("full", "suffix"):
                recomputed = _recompute_from(target, 0 if strategy == "full" else begin)
            else:
                extra = []
                if strategy == "selective" and k:
                    ranker = _rank_by_attention if rank == "attention" else _rank_by_deviation
                    extra = ranker(target, after, begin, old_end, new_end, k)
                target.replace_span(after, begin, old_end, new_end, extra)
                recomputed, selected = new_end - begin + len(extra), tuple(extra)
    except BaseException:
        conversation.restore(state)
        target.live.reset()
        raise
    return EditReport(
        name,
        old,
        value,
        strategy,
        recomputed,
        target.live.num_tokens,
        time.perf_counter() - started,
        selected,
    )


def _changed_span(before: PromptLayout, after: PromptLayout, name: str) -> tuple[int, int, int]:
    """``(begin, old end, new end)``: the tokens that differ between the renderings, covering the field's value
    tokens in both; what follows is token-identical in both."""
    old_ids, new_ids = before.token_ids, after.token_ids
    (old_b, old_e), (new_b, new_e) = before.field_spans[name], after.field_spans[name]
    limit = min(len(old_ids), len(new_ids))
    prefix = _common_length(old_ids[:limit], new_ids[:limit])
    suffix = _common_length(old_ids.flip(0)[: limit - prefix], new_ids.flip(0)[: limit - prefix])
    begin = min(old_b, new_b, prefix)
    tail = min(len(old_ids) - old_e, len(new_ids) - new_e, suffix)
    return begin, len(old_ids) - tail, len(new_ids) - tail


def _common_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two equal-length id tensors."""
    differs = (a != b).nonzero()
    return int(differs[0]) if differs.numel() else int(a.shape[0])


def _recompute_from(target: EditTarget, begin: int) -> int:
    """Drop the live cache from ``begin`` and prefill the rest of the conversation afresh (images from their
    vision outputs, nothing spliced): exact. Returns the tokens computed."""
    target.live.truncate(min(begin, target.live.num_tokens))
    return target.prefill(reuse="encoder").prefilled


def _rank_by_attention(target: EditTarget, after: PromptLayout, begin, old_end, new_end, k) -> list[int]:
    """The ``k`` tokens after the field (new prompt indices) that the context's last position attends to most,
    averaged over layers and heads, measured on the cache before the edit.

    The probe runs the last token once more as a query over the whole cache, with its own cached copy hidden
    (so it sees exactly what it saw at prefill); the cache is cropped back afterwards, bit for bit as before."""
    live, handle = target.live, target.handle
    n = live.num_tokens
    entries = torch.arange(n + 1)
    entries[n - 1] = n + 1  # its own cached copy: hidden (it sees itself as the new entry)
    entries[n] = n - 1
    mask = attention_mask(entries, torch.tensor([n - 1]), handle.dtype).to(handle.device)
    probe = live.probe(live.token_ids[-1:], live.positions[:, -1:], mask)  # the cache is cropped back
    weights = received_attention(probe.attentions)  # (n + 1,)
    weights[n - 1] = weights[n]  # the last token's attention to itself
    scores = weights[old_end:n]  # the tokens after the field, old indices
    return [i + new_end for i in top_k(scores, k)]


def _rank_by_deviation(target: EditTarget, after: PromptLayout, begin, old_end, new_end, k) -> list[int]:
    """CacheBlend-style: recompute the first layers over the new field and everything after it, and rank the
    later tokens by how far their keys and values moved from the cached ones (old keys re-rotated to the new
    positions first). The live cache is not touched (the recompute runs over a scratch cache)."""
    live, handle = target.live, target.handle
    n_old = live.num_tokens
    if old_end >= n_old:
        return []
    ids, positions = after.token_ids, after.positions
    downstream = live.segment(old_end).moved_to(int(positions[0, new_end]))  # the cached KV, re-rotated
    layer = deviation_depth(handle) - 1
    scratch = live.layer_prefix(begin, layer + 1)
    features = target.pad_features(after, range(begin, after.num_tokens))
    keys, values = recompute_first_layers(handle, scratch, ids[begin:], positions[:, begin:], features)
    scores = kv_deviation(
        keys[:, new_end:], values[:, new_end:], downstream.keys[layer, 0], downstream.values[layer, 0]
    )  # (L,): the tokens after the field
    return [i + new_end for i in top_k(scores, k)]
