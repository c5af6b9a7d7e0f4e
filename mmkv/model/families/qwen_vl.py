"""The Qwen-VL families: Qwen2-VL and Qwen2.5-VL (sectioned M-RoPE), Qwen3-VL dense and MoE (interleaved, DeepStack).

They share the tokens (``<|vision_start|><|image_pad|>...<|vision_end|>``, answers end at ``<|im_end|>``), the
hermes tool-call format and the chat template shape (``qwen_template.py``); they differ in the rotary layout,
DeepStack and the vision tower's patch size. Tiny models (``tiny-qwen2.5-vl``, ``tiny-qwen3-vl``): the real
classes shrunk to 2-3 layers, hidden 64, head_dim 16, keeping grouped-query attention, the family's M-RoPE
layout (``[2, 3, 3]`` sectioned, ``[4, 2, 2]`` interleaved; both sum to head_dim / 2), Qwen3-VL's q/k norm and
DeepStack on every layer, Qwen2.5-VL's windowed vision attention. Reference configs: the released 7B / 8B
dimensions (``mmkv.model.reference``).
"""

from __future__ import annotations

from .base import Family, VisionTokens, size_bounds
from .qwen_template import QWEN2_VL_TEMPLATE, QWEN3_VL_TEMPLATE

__all__ = ["QWEN2_5_VL", "QWEN2_VL", "QWEN3_VL", "QWEN_SPECIAL_TOKENS"]

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_TOKENS = VisionTokens("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", video=("<|video_pad|>",))
_RELEASED_IDS = {  # the released tokenizers' ids (reference configs)
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _resize(image_processor, height: int, width: int) -> tuple[int, int]:
    """Qwen's ``smart_resize``: multiples of ``patch * merge`` within the processor's pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    min_pixels, max_pixels = size_bounds(image_processor)
    factor = image_processor.patch_size * image_processor.merge_size
    return smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)


def _special_ids(tokenizer) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    return {
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
    }


def _tiny_text_config(tokenizer, mrope_section: list[int], num_layers: int) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
        "tie_word_embeddings": False,
    }


def _image_processor(patch: int, mean: list[float], std: list[float], min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=mean, image_std=std,
    )  # fmt: skip


def _tiny_qwen2_5_vl(tokenizer):
    """The tiny Qwen2.5-VL model (windowed vision attention) and its image processor."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=_tiny_text_config(tokenizer, [2, 3, 3], num_layers=2),
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
            "out_hidden_size": 64,
        },
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )  # fmt: skip
    image_processor = _image_processor(14, _CLIP_MEAN, _CLIP_STD, 28 * 28 * 4, 28 * 28 * 64)
    return Qwen2_5_VLForConditionalGeneration(config), image_processor


def _tiny_qwen3_vl(tokenizer):
    """The tiny Qwen3-VL model (DeepStack on every vision layer) and its image processor."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=_tiny_text_config(tokenizer, [4, 2, 2], num_layers=3),
        vision_config={
            "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1, 2],
        },
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )  # fmt: skip
    image_processor = _image_processor(16, [0.5] * 3, [0.5] * 3, 32 * 32 * 4, 32 * 32 * 64)
    return Qwen3VLForConditionalGeneration(config), image_processor


def _qwen2_5_vl_7b():
    """Qwen2.5-VL-7B's dimensions (config) and its hub image processor settings."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        },
        vision_config={
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
            "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 3584,
        },
        **_RELEASED_IDS,
    )  # fmt: skip
    return config, _image_processor(14, _CLIP_MEAN, _CLIP_STD, 3136, 12_845_056)


def _qwen3_vl_8b():
    """Qwen3-VL-8B's dimensions (config) and its hub image processor settings."""
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]},
        },
        vision_config={
            "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
            "out_hidden_size": 4096, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
        },
        **_RELEASED_IDS,
    )  # fmt: skip
    return config, _image_processor(16, [0.5] * 3, [0.5] * 3, 65_536, 16_777_216)


_SHARED = dict(
    tokens=_TOKENS,
    end_of_turn="<|im_end|>",
    special_tokens=QWEN_SPECIAL_TOKENS,
    image_processor="transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil",
    resize=_resize,
    config_token_ids=_special_ids,
    tool_format="hermes",
)
_SECTIONED = dict(rotary_kind="sectioned", default_section=(16, 24, 24), chat_template=QWEN2_VL_TEMPLATE)
QWEN2_VL = Family(
    name="qwen2_vl",
    label="Qwen2-VL",
    model_classes={"qwen2_vl": "Qwen2VLForConditionalGeneration"},
    aliases={"qwen2-vl-2b": "Qwen/Qwen2-VL-2B-Instruct", "qwen2-vl-7b": "Qwen/Qwen2-VL-7B-Instruct"},
    **_SECTIONED,
    **_SHARED,
)
QWEN2_5_VL = Family(
    name="qwen2_5_vl",
    label="Qwen2.5-VL",
    model_classes={"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"},
    aliases={
        "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct",
        "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
        "qwen2.5-vl-32b": "Qwen/Qwen2.5-VL-32B-Instruct",
        "qwen2.5-vl-72b": "Qwen/Qwen2.5-VL-72B-Instruct",
    },
    tiny_name="tiny-qwen2.5-vl",
    build_tiny=_tiny_qwen2_5_vl,
    references={"qwen2.5-vl-7b": _qwen2_5_vl_7b},
    **_SECTIONED,
    **_SHARED,
)
QWEN3_VL = Family(
    name="qwen3_vl",
    label="Qwen3-VL",
    model_classes={"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"},
    rotary_kind="interleaved",
    default_section=(24, 20, 20),
    has_deepstack=True,
    chat_template=QWEN3_VL_TEMPLATE,
    aliases={
        "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
        "qwen3-vl-4b": "Qwen/Qwen3-VL-4B-Instruct",
        "qwen3-vl-8b": "Qwen/Qwen3-VL-8B-Instruct",
        "qwen3-vl-32b": "Qwen/Qwen3-VL-32B-Instruct",
        "qwen3-vl-30b-a3b": "Qwen/Qwen3-VL-30B-A3B-Instruct",
    },
    tiny_name="tiny-qwen3-vl",
    build_tiny=_tiny_qwen3_vl,
    references={"qwen3-vl-8b": _qwen3_vl_8b},
    **_SHARED,
)  # fmt: skip
