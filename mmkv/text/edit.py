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
  context's last position (``rank="attention"``) or by how far their layer-1 KV moves when the first two layers
  are recomputed (``rank="deviation"``, the CacheBlend-style baseline);
- ``suffix``: recompute everything from the value on (exact);
- ``full``: recompute the whole context (the reference).

Every strategy reports the tokens it recomputed, their fraction of the context, and the time taken.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
from transformers import DynamicCache

from ..compat import cache_argument_name, crop_cache
from ..errors import UnsupportedInputError
from ..kv.prefill import prefill_span
from ..kv.segment import segment_from_cache
from ..prompt.fields import fill_template
from .erratum import DEFAULT_ERRATUM, erratum_line

if TYPE_CHECKING:
    from ..session import Session

__all__ = ["RANKINGS", "STRATEGIES", "EditReport", "edit_field"]

Strategy = Literal["erratum", "in_place", "selective", "suffix", "full"]
STRATEGIES: tuple[str, ...] = ("erratum", "in_place", "selective", "suffix", "full")
RANKINGS: tuple[str, ...] = ("attention", "deviation")


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


def edit_field(
    session: Session,
    name: str,
    value: str,
    strategy: Strategy = "suffix",
    *,
    k: int = 8,
    rank: str = "attention",
    erratum: str = DEFAULT_ERRATUM,
    erratum_role: str = "system",
) -> EditReport:
    """Change field ``name`` of ``session`` to ``value`` by ``strategy`` (see the module docstring).

    The live cache is first brought up to the conversation as it stands (not timed). Raises ``ValueError`` /
    ``KeyError`` / ``TypeError`` for a bad strategy, field or value, with the session unchanged.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown edit strategy {strategy!r}; choose from {STRATEGIES}")
    if rank not in RANKINGS:
        raise ValueError(f"unknown ranking {rank!r}; choose from {RANKINGS}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not isinstance(value, str) or not value:
        raise TypeError(f"field {name!r}: the new value must be a non-empty str")
    item = session.field_item(name)
    old = session.field_values[name]
    session.prefill()
    started = time.perf_counter()
    if strategy == "erratum":
        session.add_text(erratum_line(name, value, erratum), role=erratum_role, new_message=True)
        try:
            stats = session.prefill()
        except BaseException:
            session.messages.pop()  # the erratum's own message: the conversation is as it was
            raise
        session.field_values[name] = value
        return EditReport(
            name, old, value, strategy, stats.prefilled, session.live_tokens, time.perf_counter() - started
        )

    before, _ = session.render_prompt(None, add_generation_prompt=False)
    previous = (item["fields"][name], item["text"])
    item["fields"][name] = value
    item["text"] = fill_template(item["template"], item["fields"])[0]
    try:
        after, order = session.render_prompt(None, add_generation_prompt=False)
        if before.field_spans is None or after.field_spans is None:
            raise UnsupportedInputError(
                "this chat template rewrites message text, so fields cannot be located"
            )
        begin, old_end, new_end = _changed_span(before, after, name)
        with torch.inference_mode():
            if strategy in ("full", "suffix"):
                recomputed = _recompute_from(session, 0 if strategy == "full" else begin)
                selected: tuple[int, ...] = ()
            else:
                extra = []
                if strategy == "selective" and k:
                    ranker = _rank_by_attention if rank == "attention" else _rank_by_deviation
                    extra = ranker(session, after, order, begin, old_end, new_end, k)
                session.replace_tokens(after, order, begin, old_end, new_end, extra)
                recomputed, selected = new_end - begin + len(extra), tuple(extra)
    except BaseException:
        item["fields"][name], item["text"] = previous
        session.reset_live()
        raise
    session.field_values[name] = value
    return EditReport(
        name, old, value, strategy, recomputed, session.live_tokens, time.perf_counter() - started, selected
    )


def _changed_span(before, after, name: str) -> tuple[int, int, int]:
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


@contextlib.contextmanager
def _policy(session: Session, reuse: str):
    """Run with ``session.config.reuse`` set to ``reuse``."""
    saved = session.config
    session.config = replace(saved, reuse=reuse)
    try:
        yield
    finally:
        session.config = saved


def _recompute_from(session: Session, begin: int) -> int:
    """Drop the live cache from ``begin`` and prefill the rest of the conversation afresh (images from their
    vision outputs, nothing spliced): exact. Returns the tokens computed."""
    with _policy(session, "encoder"):
        session.truncate_live(begin)
        return session.prefill().prefilled


def _rank_by_attention(session, after, order, begin, old_end, new_end, k) -> list[int]:
    """The ``k`` tokens after the field (new prompt indices) that the context's last position attends to most,
    averaged over layers and heads, measured on the cache before the edit."""
    handle, cache = session.model, session._cache
    n = session.live_tokens
    last_id, last_pos = session._live_ids[-1:], session._live_positions[:, -1:]
    mask = torch.zeros(1, 1, 1, n + 1, dtype=handle.dtype)
    mask[..., n - 1] = torch.finfo(handle.dtype).min  # its own cached copy: seen once, as the new entry
    model = handle.model
    saved = model.config.text_config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns attention weights
    try:
        out = model(
            input_ids=last_id[None].to(handle.device),
            position_ids=last_pos[:, None].to(handle.device),
            attention_mask=mask.to(handle.device),
            use_cache=True,
            output_attentions=True,
            logits_to_keep=1,
            **{cache_argument_name(model): cache},
        )
    finally:
        model.set_attn_implementation(saved)
        crop_cache(cache, n)
    weights = torch.stack([a[0, :, 0].float() for a in out.attentions]).mean((0, 1)).cpu()  # (n + 1,)
    weights[n - 1] = weights[n]  # the last token's attention to itself
    scores = weights[old_end:n]  # the tokens after the field, old indices
    top = torch.topk(scores, min(k, int(scores.shape[0]))).indices + old_end
    return sorted(int(i) + new_end - old_end for i in top)


def _rank_by_deviation(session, after, order, begin, old_end, new_end, k) -> list[int]:
    """CacheBlend-style: recompute the first two layers over the new field and everything after it, and rank the
    later tokens by how far their layer-1 keys and values moved from the cached ones (old keys re-rotated to the
    new positions first). The rest of the cache is not touched."""
    handle = session.model
    n_old = session.live_tokens
    if old_end >= n_old:
        return []
    ids, positions, pieces = session.layout(after, order)
    downstream = segment_from_cache(
        session._cache,
        old_end,
        session._live_ids[old_end:],
        session._live_positions[:, old_end:],
        handle.layout,
    ).moved_to(int(positions[0, new_end]))  # the cached KV, re-rotated to where it now sits
    depth = min(2, handle.num_layers)
    scratch = DynamicCache()
    for layer in range(depth):
        source = session._cache.layers[layer]
        scratch.update(source.keys[:, :, :begin].clone(), source.values[:, :, :begin].clone(), layer)
    features = session.pad_features(pieces, order, range(begin, int(ids.shape[0])))
    language_model = handle.model.model.language_model
    layers = language_model.layers
    language_model.layers = layers[:depth]
    try:
        prefill_span(handle, ids[begin:], positions[:, begin:], context=scratch, features=features)
    finally:
        language_model.layers = layers
    fresh = scratch.layers[depth - 1]
    dk = (fresh.keys[0, :, new_end:] - downstream.keys[depth - 1, 0]).float().norm(dim=(0, 2))  # (L,)
    dv = (fresh.values[0, :, new_end:] - downstream.values[depth - 1, 0]).float().norm(dim=(0, 2))
    scores = (dk + dv).cpu()
    top = torch.topk(scores, min(k, int(scores.shape[0]))).indices + new_end
    return sorted(int(i) for i in top)
