"""One place for transformers' API drift across the tested range (5.17 to 5.24).

- the cache argument of ``forward`` is ``cache=`` from 5.24 and ``past_key_values=`` before (the old name
  warns in 5.24 and is removed in 5.40);
- precomputed vision-tower outputs are passed as ``mm_encoder_outputs={"image": ...}`` from 5.24; before that
  the model always calls its own ``get_image_features``, so we hand it the cached result through that method
  for the duration of one call;
- Qwen3-VL's forward reads DeepStack features as one tuple of per-image tensors per layer in 5.24, and as one
  tensor over all images per layer in 5.17.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from transformers import PreTrainedModel

__all__ = [
    "cache_argument_name",
    "crop_cache",
    "deepstack_split_per_image",
    "forward_with_encoder_outputs",
    "supports_encoder_outputs",
]


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def cache_argument_name(model: PreTrainedModel) -> str:
    """``"cache"`` or ``"past_key_values"``: how this transformers names the KV cache argument of ``forward``."""
    return "cache" if "cache" in _forward_parameters(type(model)) else "past_key_values"


def supports_encoder_outputs(model: PreTrainedModel) -> bool:
    """Whether ``forward`` takes precomputed vision outputs (``mm_encoder_outputs``, transformers >= 5.24)."""
    return "mm_encoder_outputs" in _forward_parameters(type(model))


def deepstack_split_per_image(model: PreTrainedModel) -> bool:
    """Whether this transformers' Qwen3-VL forward expects DeepStack features split per image.

    Read off the forward's source once per class: the 5.24 forward concatenates per-image tuples
    (``torch.cat(feat, dim=0) for feat in deepstack_image_embeds``), older ones use the tensors as they are.
    """
    return _forward_concatenates_deepstack(type(model.model))


@functools.cache
def _forward_concatenates_deepstack(inner_class: type) -> bool:
    return "for feat in deepstack_image_embeds" in inspect.getsource(inner_class.forward)


def _with_image_features(model: PreTrainedModel, encoder_output) -> PreTrainedModel:
    """A per-call shallow copy of ``model`` whose inner model's ``get_image_features`` returns
    ``encoder_output`` (older transformers). The two copied modules share every submodule and weight with
    ``model``; ``model`` itself is not changed, so other threads using it are not disturbed."""
    inner = copy.copy(model.model)
    inner.__dict__["get_image_features"] = lambda *args, **kwargs: encoder_output
    outer = copy.copy(model)
    outer.__dict__["_modules"] = {**model._modules, "model": inner}
    return outer


def forward_with_encoder_outputs(model: PreTrainedModel, encoder_output, **kwargs):
    """``model(**kwargs)`` with the vision tower's work replaced by ``encoder_output`` (a ``get_image_features``
    result for exactly the images whose pads are in ``input_ids``). Changes nothing on ``model``."""
    if supports_encoder_outputs(model):
        return model(mm_encoder_outputs={"image": encoder_output}, **kwargs)
    placeholder = torch.zeros(1, 1)  # only needs to be non-None: the patched method ignores it
    return _with_image_features(model, encoder_output)(pixel_values=placeholder, **kwargs)


def crop_cache(cache, keep: int) -> None:
    """Drop every cache entry after the first ``keep`` (mutates ``cache``). ``crop`` takes a negative count
    of entries to drop in every tested version (only that form from 5.20); ``crop(0)`` would empty it."""
    drop = cache.get_seq_length() - keep
    if drop < 0:
        raise ValueError(f"cannot keep {keep} entries of a cache holding {cache.get_seq_length()}")
    if drop:
        cache.crop(-drop)
