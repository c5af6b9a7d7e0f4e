"""``ModelHandle``: the one object everything in mmkv takes, and the model fingerprint used in cache keys.

A handle bundles the transformers model, the image-only processor, the family (``mmkv.model.families``: what
mmkv knows about the architecture), the rotary layout and the position rule. Its ``fingerprint`` names what produced a KV tensor: the architecture config, the weights and
the dtype. Two handles with the same fingerprint produce the same KV for the same tokens; anything cached under
one fingerprint must never be served to another.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NewType

import torch
from transformers import PreTrainedModel

from ..mrope import PositionRule, RotaryLayout
from .families import Family
from .processor import VLProcessor

__all__ = ["ModelFingerprint", "ModelHandle", "model_fingerprint"]

ModelFingerprint = NewType("ModelFingerprint", str)  # full-width SHA-256 hex digest


# config keys that do not change what the model computes
_VOLATILE_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "dtype",
        "torch_dtype",
        "architectures",
        "_commit_hash",
        "_attn_implementation_autoset",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "use_cache",
    }
)
_SAMPLE_BYTES = 1 << 16  # bytes hashed from each end of every weight tensor


def _canonical_config(value):
    if isinstance(value, dict):
        return {k: _canonical_config(v) for k, v in sorted(value.items()) if k not in _VOLATILE_KEYS}
    if isinstance(value, (list, tuple)):
        return [_canonical_config(v) for v in value]
    return value


def model_fingerprint(model: PreTrainedModel) -> ModelFingerprint:
    """SHA-256 over the architecture config, every weight's name, shape and dtype, and the first and last
    64 KiB of every weight's bytes.

    Sampling keeps this to a fraction of a second for an 8B model while any fine-tune, a different checkpoint
    or another dtype changes it. Does not change the model.
    """
    digest = hashlib.sha256(b"mmkv-fingerprint-v1\0")
    config = _canonical_config(model.config.to_dict())
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)  # (numel,)
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\0".encode())
        per_end = max(1, _SAMPLE_BYTES // max(1, tensor.element_size()))
        ends = [flat[:per_end]] if flat.numel() <= 2 * per_end else [flat[:per_end], flat[-per_end:]]
        for part in ends:
            digest.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return ModelFingerprint(digest.hexdigest())


@dataclass(frozen=True, eq=False)
class ModelHandle:
    """A loaded vision-language model and everything mmkv needs to know about it. Immutable; the model is in
    eval mode."""

    name: str  # what it was loaded as: an alias, a hub id or a path
    model: PreTrainedModel  # transformers *ForConditionalGeneration
    processor: VLProcessor  # tokenizer + image processor + chat template
    family: Family  # architecture family: everything mmkv asks about it
    rotary: RotaryLayout  # rotary channel layout of the language model
    position_rule: PositionRule  # M-RoPE position rule (merge size)
    fingerprint: ModelFingerprint  # config + weights + dtype identity, for cache keys
    position_limit: int | None = None  # a bound on positions other than the config's (with_position_limit)
    _variants: dict = field(default_factory=dict, repr=False)  # (eager, num_layers) -> model sharing weights
    _variants_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_parts(
        cls, name: str, model: PreTrainedModel, processor: VLProcessor, family: Family
    ) -> ModelHandle:
        """Build a handle, deriving the rotary layout, position rule and fingerprint from the model itself
        (through its family)."""
        rotary_layout = family.rotary_layout(model)
        merge = int(model.config.vision_config.spatial_merge_size)
        if merge != processor.merge_size:
            raise ValueError(
                f"model merge size {merge} differs from the image processor's {processor.merge_size}"
            )
        return cls(
            name,
            model,
            processor,
            family,
            rotary_layout,
            family.position_rule(merge),
            model_fingerprint(model),
        )

    @property
    def tokenizer(self):
        """The processor's tokenizer."""
        return self.processor.tokenizer

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of every KV tensor mmkv produces)."""
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.model.device

    @property
    def text_config(self):
        """The language model's config."""
        return self.model.config.get_text_config()

    @functools.cached_property
    def num_layers(self) -> int:
        """Decoder layers of the language model (one K and one V tensor each per cached token)."""
        return int(self.text_config.num_hidden_layers)

    @functools.cached_property
    def kv_shape(self) -> tuple[int, int, int]:
        """``(layers, kv heads, head_dim)`` of every KV segment this model makes."""
        return self.num_layers, int(self.text_config.num_key_value_heads), int(self.rotary.head_dim)

    @property
    def max_positions(self) -> int:
        """Positions the language model supports (``max_position_embeddings``; unbounded when unset), or the
        handle's own ``position_limit``."""
        if self.position_limit is not None:
            return self.position_limit
        return int(getattr(self.text_config, "max_position_embeddings", None) or 1 << 62)

    def with_position_limit(self, limit: int) -> ModelHandle:
        """The same model under another bound on positions (a benchmark timing long prompts on a model trained
        on short ones): a new handle sharing everything; this one and its model's config are unchanged."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        return dataclasses.replace(self, position_limit=limit)

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies over all layers (cached: it reads the weights' dtype, ~30 us)."""
        _, kv_heads, head_dim = self.kv_shape
        return 2 * self.num_layers * kv_heads * head_dim * self.dtype.itemsize

    def variant(self, *, eager: bool = False, num_layers: int | None = None) -> PreTrainedModel:
        """The model as a call that needs another attention kernel (``eager``: the only one that returns
        attention weights) or fewer language-model layers (the first ``num_layers``) runs it: a second module
        tree **sharing every weight and buffer** with ``model``, made once per setting and kept. ``model`` and
        its config are never changed, so calls on the handle from other threads are not disturbed."""
        if not eager and num_layers in (None, self.num_layers):
            return self.model
        if num_layers is not None and not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        key = (eager, num_layers)
        with self._variants_lock:
            found = self._variants.get(key)
            if found is None:
                shared = {id(t): t for t in itertools.chain(self.model.parameters(), self.model.buffers())}
                found = copy.deepcopy(self.model, shared)  # new modules and configs, the same tensors
                if eager:
                    found.set_attn_implementation("eager")
                if num_layers is not None:
                    language_model = found.model.language_model
                    language_model.layers = type(language_model.layers)(
                        list(language_model.layers)[:num_layers]
                    )
                self._variants[key] = found
            return found

    def save(self, directory: str | Path) -> Path:
        """Write a standard checkpoint directory (config, safetensors, tokenizer, processor, chat template)
        that ``mmkv.load(directory)`` loads back through the same path as a real model."""
        directory = Path(directory)
        self.model.save_pretrained(directory, safe_serialization=True)
        self.processor.save_pretrained(directory)
        return directory
