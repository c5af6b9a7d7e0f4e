"""Configs of released checkpoints' dimensions, for size and timing work with random weights (no download).

``reference_config("qwen3-vl-8b")`` is a full ``Qwen3VLConfig`` with the 8B model's language and vision
dimensions; ``build_reference("qwen3-vl-8b")`` builds a random-weight model of that size as a ``ModelHandle``
(optionally with fewer layers, for machines that cannot hold or run the whole model), with the hub's image
processor settings and mmkv's small tokenizer (its special-token ids are written into the config). Each
family declares its own (``Family.references``).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from .families import FAMILIES, Family

__all__ = ["REFERENCE_ARCHS", "build_reference", "reference_config"]

_BY_ARCH: dict[str, Family] = {arch: f for f in dict.fromkeys(FAMILIES.values()) for arch in f.references}
REFERENCE_ARCHS = tuple(_BY_ARCH)


def _reference(arch: str):
    if arch not in _BY_ARCH:
        raise ValueError(f"unknown reference architecture {arch!r}; choose one of {REFERENCE_ARCHS}")
    family = _BY_ARCH[arch]
    config, image_processor = family.references[arch]()
    return family, config, image_processor


def reference_config(arch: str) -> PretrainedConfig:
    """The config of ``arch`` (one of ``REFERENCE_ARCHS``) with the released model's dimensions."""
    return _reference(arch)[1]


def _cut_depth(config, lm_layers: int | None, vision_layers: int | None) -> None:
    """Keep the first ``lm_layers`` / ``vision_layers`` layers (in place on ``config``)."""
    text, vision = config.text_config, config.vision_config
    if lm_layers:
        text.num_hidden_layers = lm_layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:lm_layers]
    if vision_layers:
        vision.depth = vision_layers
        if hasattr(vision, "fullatt_block_indexes"):
            vision.fullatt_block_indexes = [i for i in vision.fullatt_block_indexes if i < vision_layers] or [
                vision_layers - 1
            ]
        if hasattr(vision, "deepstack_visual_indexes"):
            keep = [i for i in vision.deepstack_visual_indexes if i < vision_layers]
            vision.deepstack_visual_indexes = keep or [vision_layers - 1]


def build_reference(
    arch: str,
    lm_layers: int | None = None,
    vision_layers: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
):
    """A random-weight ``ModelHandle`` of ``arch``'s dimensions; ``lm_layers`` / ``vision_layers`` cut the
    depth (per-layer cost is unchanged, so per-layer ratios carry over to the full model)."""
    from .handle import ModelHandle
    from .processor import VLProcessor
    from .tiny import tiny_tokenizer

    family, config, image_processor = _reference(arch)
    tokenizer = tiny_tokenizer(family.name)
    for key, value in family.config_token_ids(tokenizer).items():  # the released ids -> the small tokenizer's
        setattr(config, key, value)
    _cut_depth(config, lm_layers, vision_layers)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            model = family.model_class(config.model_type)._from_config(config, dtype=dtype)
        finally:
            torch.set_default_dtype(torch.float32)
    processor = VLProcessor(tokenizer, image_processor, family.chat_template, family)
    return ModelHandle.from_parts(f"random-{arch}", model.eval(), processor, family)
