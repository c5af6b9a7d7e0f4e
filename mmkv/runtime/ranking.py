"""Token rankings: which tokens of a context to recompute when only some can be. The one place that scores them,
for both the repair beyond the seam (``mmkv.runtime.repair``) and the selective field edit (``mmkv.text.edit``).

Two rankings (``mmkv.policy.Ranking``):

- ``"deviation"`` (CacheBlend's selection): the first ``DEVIATION_LAYERS`` layers run again over the tokens in
  their new context, on a scratch cache (``recompute_first_layers``); a token scores how far the last of those
  layers' keys and values moved from the cached ones (``kv_deviation``). Layer 0's KV depends only on a token's
  own embedding and position, so layer 1 is the first that sees the context;
- ``"attention"``: some query tokens run once more over the context (an eager probe, ``LiveCache.probe``); a
  token scores the attention it receives, averaged over layers, heads and queries (``received_attention``).

``top_k`` takes the highest scores, ties to the earlier token. Nothing here changes a live cache: the caller
hands in copies (``LiveCache.layer_prefix``) or the probe's output. Example, three cached tokens of which the
second moved most when recomputed::

    keys, values = recompute_first_layers(handle, scratch, ids, positions, features)   # (kv_heads, T, D) each
    scores = kv_deviation(keys[:, spliced], values[:, spliced], cached_keys, cached_values)  # (3,) [0.1, 2.0, 0.4]
    top_k(scores, 1)                                                                   # [1]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ..kv.prefill import prefill_span
from ..kv.vision import ImageFeatures
from ..model.handle import ModelHandle

__all__ = [
    "DEVIATION_LAYERS", "PROBE_TOKENS", "deviation_depth", "kv_deviation", "received_attention",
    "recompute_first_layers", "top_k",
]  # fmt: skip

DEVIATION_LAYERS = 2  # the deviation pass runs this many first layers and compares the last of them
PROBE_TOKENS = 16  # an attention probe's queries at most (bounds the attention weights' memory)


def deviation_depth(handle: ModelHandle) -> int:
    """Layers the deviation pass runs: ``DEVIATION_LAYERS``, or all of a shallower model's."""
    return min(DEVIATION_LAYERS, handle.num_layers)


def recompute_first_layers(
    handle: ModelHandle,
    scratch: DynamicCache | None,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    features: Sequence[ImageFeatures] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of layer ``deviation_depth(handle) - 1`` after running that many first layers over
    ``token_ids`` (``(n,)``) at ``positions`` (``(3, n)``), after the context in ``scratch`` (a cache of exactly
    those layers, e.g. ``LiveCache.layer_prefix``; None: no context). Each ``(kv_heads, T, D)``, ``T`` the context
    plus ``n``, indexed by prompt position when the context is the prompt's prefix. Extends ``scratch`` (the
    caller's copy); the model is not changed (its two-layer variant runs)."""
    depth = deviation_depth(handle)
    cache = prefill_span(
        handle, token_ids, positions, context=scratch, features=list(features), keep_segment=False,
        num_layers=depth,
    ).cache  # fmt: skip
    layer = cache.layers[depth - 1]
    return layer.keys[0], layer.values[0]


def kv_deviation(
    fresh_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    cached_keys: torch.Tensor,
    cached_values: torch.Tensor,
) -> torch.Tensor:
    """``(n,)`` float on the host: per token, the L2 norm (over heads and channels) of its key's move plus its
    value's move. All four ``(kv_heads, n, D)``; the cached ones already at the fresh ones' positions.

    >>> k = torch.zeros(1, 3, 2); moved = k.clone(); moved[0, 1] = torch.tensor([3.0, 4.0])
    >>> kv_deviation(moved, k, k, k).tolist()
    [0.0, 5.0, 0.0]
    """
    device = fresh_keys.device
    dk = (fresh_keys - cached_keys.to(device)).float().norm(dim=(0, 2))
    dv = (fresh_values - cached_values.to(device)).float().norm(dim=(0, 2))
    return (dk + dv).cpu()


def received_attention(attentions: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(K,)`` float on the host: the attention each of ``K`` keys receives, averaged over layers, heads and
    queries. ``attentions``: one ``(1, heads, Q, K)`` weight tensor per layer (an eager probe's)."""
    return torch.stack([a[0].float().mean((0, 1)) for a in attentions]).mean(0).cpu()


def top_k(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the ``k`` highest ``scores`` (``(n,)``; ties to the earlier index; all of them when ``k >= n``),
    ascending.

    >>> top_k(torch.tensor([1.0, 3.0, 0.5, 3.0]), 2), top_k(torch.tensor([2.0, 2.0, 2.0]), 1)
    ([1, 3], [0])
    """
    order = torch.sort(scores.float().cpu(), descending=True, stable=True).indices
    return sorted(order[: max(0, k)].tolist())
