"""Configs of released checkpoints' dimensions, for size and timing work with random weights (no download).

``reference_config("qwen3-vl-8b")`` is a full ``Qwen3VLConfig`` with the 8B model's language and vision
dimensions; ``Qwen3VLForConditionalGeneration(config)`` then builds a random-weight model of the real size.
"""

from __future__ import annotations

from transformers import PretrainedConfig, Qwen2_5_VLConfig, Qwen3VLConfig

__all__ = ["REFERENCE_ARCHS", "reference_config"]

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
