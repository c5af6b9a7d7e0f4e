"""``prefill_span``: run the model over one span of tokens in a given context, at explicit positions.

Every cache-building path in mmkv goes through here: a span (text, or an image's pads with their markers) is
fed to the transformers model over a live ``DynamicCache`` holding the context, with explicit ``(3, L)``
M-RoPE position ids (never the model's implicit ones, which restart wrong after a splice). The cache is
extended in place, as transformers does; the span's own KV comes back as a ``KVSegment`` together with the
logits of its last token.

Image pads get their vision features from ``images`` (pixel values: the vision tower runs) or from
``features`` (cached ``ImageFeatures``: the tower is skipped, DeepStack features included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..compat import cache_argument_name, forward_with_encoder_outputs
from ..model.handle import ModelHandle
from ..model.processor import ImageInputs
from .segment import KVSegment, SegmentKind, segment_from_cache
from .vision import ImageFeatures, join_features

__all__ = ["PrefillResult", "new_cache", "prefill_span"]


@dataclass(frozen=True, eq=False)
class PrefillResult:
    """What one prefill produced."""

    segment: KVSegment | None  # the span's own KV, ids and positions (None when not kept: keep_segment=False)
    logits: torch.Tensor  # (vocab,) float32 logits after the span's last token
    cache: DynamicCache  # the context cache, now extended by the span
    attentions: tuple[torch.Tensor, ...] | None = (
        None  # per layer (1, heads, L, K) weights, with attentions=True
    )


def new_cache(handle: ModelHandle) -> DynamicCache:
    """An empty ``DynamicCache`` laid out for ``handle``'s language model."""
    return DynamicCache(config=handle.text_config)


@torch.inference_mode()
def prefill_span(
    handle: ModelHandle,
    token_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    context: DynamicCache | None = None,
    images: ImageInputs | None = None,
    features: Sequence[ImageFeatures] | None = None,
    kind: SegmentKind | None = None,
    digest: str = "",
    attention_mask: torch.Tensor | None = None,
    keep_segment: bool = True,
    attentions: bool = False,
    num_layers: int | None = None,
) -> PrefillResult:
    """Prefill ``token_ids`` (``(L,)``) at ``position_ids`` (``(3, L)``) after the KV already in ``context``.

    Mutates ``context`` (extends it by ``L`` entries); pass ``None`` to start from an empty cache.
    ``images`` (pixels) or ``features`` (cached vision outputs) cover exactly the image pads in ``token_ids``,
    in order.
    ``attention_mask``: an optional ``(1, 1, L, context + L)`` additive float mask (0 = attend) replacing the
    causal one, for spans whose context holds entries that come later in the prompt.
    ``kind`` defaults to "image" when the span has image pads. ``keep_segment=False`` skips copying the span's
    own KV out of the cache (``segment`` is then None: decode steps and plan execution need only the cache).
    ``attentions=True`` runs the call on the handle's eager-attention variant (the only implementation that returns
    weights; ``ModelHandle.variant``: the same weights, the shared model untouched) and returns them.
    ``num_layers`` runs only the first that many language-model layers (the layer-cut variant; the logits are
    then not the model's, and only those layers' KV is appended). Raises ``ValueError`` on shape mismatches or when pads are given no features.
    """
    token_ids = token_ids.reshape(-1).long()
    length = token_ids.shape[0]
    if position_ids.shape != (3, length):
        raise ValueError(f"position_ids must be (3, {length}), got {tuple(position_ids.shape)}")
    num_pads = int((token_ids == handle.processor.image_token_id).sum())
    if num_pads and images is None and not features:
        raise ValueError(f"the span has {num_pads} image pads but neither images nor features were given")
    if images is not None and features:
        raise ValueError("pass images or features, not both")
    if features and sum(f.num_pads for f in features) != num_pads:
        raise ValueError(f"features cover {sum(f.num_pads for f in features)} pads, the span has {num_pads}")

    cache = context if context is not None else new_cache(handle)
    begin = cache.get_seq_length()
    device = handle.device
    kwargs = {
        "input_ids": token_ids[None].to(device),  # (1, L)
        "position_ids": position_ids[:, None, :].to(device),  # (3, 1, L)
        cache_argument_name(handle.model): cache,
        "use_cache": True,
        "logits_to_keep": 1,
    }
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if images is not None:
        kwargs["pixel_values"] = images.pixel_values.to(device, handle.dtype)
        kwargs["image_grid_thw"] = images.image_grid_thw.to(device)
    if attentions:
        kwargs["output_attentions"] = True
    model = handle.variant(eager=attentions, num_layers=num_layers)  # handle.model unless a variant is asked
    if features:
        out = forward_with_encoder_outputs(model, join_features(handle, features), **kwargs)
    else:
        out = model(**kwargs)
    segment = None
    if keep_segment:
        kind = kind or ("image" if num_pads else "text")
        segment = segment_from_cache(cache, begin, token_ids, position_ids, handle.rotary, kind, digest)
    weights = tuple(out.attentions) if attentions else None
    return PrefillResult(segment=segment, logits=out.logits[0, -1].float(), cache=cache, attentions=weights)
