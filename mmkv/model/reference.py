"""Configs of released checkpoints' dimensions, for size and timing work with random weights (no download).

``reference_config("qwen3-vl-8b")`` is a full ``Qwen3VLConfig`` with the 8B model's language and vision
dimensions; ``build_reference("qwen3-vl-8b")`` builds a random-weight model of that size as a ``ModelHandle``
(optionally with fewer layers, for machines that cannot hold or run the whole model), with the hub's image
processor settings and mmkv's small tokenizer (its special-token ids are written into the config).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

__all__ = ["REFERENCE_ARCHS", "build_reference", "reference_config"]

_QWEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}

REFERENCE_ARCHS = ("qwen2.5-vl-7b", "qwen3-vl-8b")


def reference_config(arch: str) -> PretrainedConfig:
    """The config of ``arch`` (one of ``REFERENCE_ARCHS``) with the released model's dimensions."""
    if arch == "qwen2.5-vl-7b":
        return Qwen2_5_VLConfig(
            text_config={
                "vocab_size": 152064,
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "max_position_embeddings": 128000,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
            },
            vision_config={
                "depth": 32,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "patch_size": 14,
                "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31],
                "out_hidden_size": 3584,
            },
            **_QWEN_IDS,
        )
    if arch == "qwen3-vl-8b":
        return Qwen3VLConfig(
            text_config={
                "vocab_size": 151936,
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "num_hidden_layers": 36,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "max_position_embeddings": 262144,
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]},
            },
            vision_config={
                "depth": 27,
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_heads": 16,
                "patch_size": 16,
                "out_hidden_size": 4096,
                "num_position_embeddings": 2304,
                "deepstack_visual_indexes": [8, 16, 24],
            },
            **_QWEN_IDS,
        )
    raise ValueError(f"unknown reference architecture {arch!r}; choose one of {REFERENCE_ARCHS}")


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
    import transformers

    from .handle import FAMILIES, ModelHandle
    from .processor import VLProcessor
    from .templates import QWEN2_VL_TEMPLATE, QWEN3_VL_TEMPLATE
    from .tiny import _special_ids, _tiny_tokenizer

    config = reference_config(arch)
    tokenizer = _tiny_tokenizer()
    for key, value in _special_ids(tokenizer).items():
        setattr(config, key, value)
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
    family = FAMILIES[config.model_type]
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            model = getattr(transformers, family.model_class)._from_config(config, dtype=dtype)
        finally:
            torch.set_default_dtype(torch.float32)
    if family.name == "qwen3_vl":
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=16,
            merge_size=2,
            min_pixels=65_536,
            max_pixels=16_777_216,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        )
        template = QWEN3_VL_TEMPLATE
    else:
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=14,
            merge_size=2,
            min_pixels=3136,
            max_pixels=12_845_056,
            image_mean=list(OPENAI_CLIP_MEAN),
            image_std=list(OPENAI_CLIP_STD),
        )
        template = QWEN2_VL_TEMPLATE
    processor = VLProcessor(tokenizer, image_processor, template)
    return ModelHandle.from_parts(f"random-{arch}", model.eval(), processor, family)
