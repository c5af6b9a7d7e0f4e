"""The GLM-4.xV families: GLM-4.1V (transformers ``glm4v``) and GLM-4.5V (``glm4v_moe``).

What sets them apart from Qwen (all checked in ``tests/model/families/test_glm4v.py`` against the models' own code):

- **rotary**: only the first half of each head carries a position (``partial_rotary_factor`` 0.5; frequencies
  over that half), sectioned ``[8, 12, 12]`` as Qwen2-VL; GLM-4.1V turns **adjacent** channel pairs
  ``(2j, 2j + 1)`` (``rotate_half_llm``), GLM-4.5V the halves ``(j, j + R/2)``: two records;
- **positions**: ``get_rope_index`` gives still images the Qwen rule (``(s, s + r, s + c)``, ``max(h', w')``
  slots), so ``PositionRule`` serves unchanged; no DeepStack;
- **tokens**: an image is ``<|begin_of_image|>`` + ``<|image|>`` pads + ``<|end_of_image|>``; turns open with
  ``<|system|>`` / ``<|user|>`` / ``<|assistant|>`` / ``<|observation|>`` and have no closing token: an answer
  ends where the model opens the next turn (``<|user|>``, the released generation config's stop token);
- **images**: GLM's ``smart_resize`` bounds ``temporal_patch * h * w`` (an image gets half the pixels Qwen's
  would under the same bounds) and scales small images up.
- **tool calls**: the released GLM-4.5V template writes ``<tool_call>NAME\\n<arg_key>..</arg_key>
  <arg_value>..</arg_value></tool_call>``; mmkv does not parse or constrain that format yet, so a request with
  tools is refused with a clear error (``tool_format=None``) and the template below lists no tools.

The template of the checkpoints mmkv builds (tiny): ``[gMASK]<sop>`` then, per message, ``<|role|>\\n`` + content;
the generation prompt ``<|assistant|>\\n`` (no thinking block)::

    [gMASK]<sop><|system|>\\nAct.<|user|>\\n<|begin_of_image|><|image|><|end_of_image|>Next?<|assistant|>\\n
"""

from __future__ import annotations

import dataclasses

from .base import Family, VisionTokens, size_bounds

__all__ = ["GLM4V", "GLM4V_MOE", "GLM_SPECIAL_TOKENS"]

# the released tokenizer's added tokens from 151329, in order (GLM-4.5's vocabulary; GLM-4.1V's <|image|> and
# <|video|> are 151343/151344 instead: real checkpoints bring their own tokenizer, ids are read from it)
GLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink", "<|begin_of_box|>", "<|end_of_box|>",
    "<|image|>", "<|video|>",
)  # fmt: skip
_TOKENS = VisionTokens(
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    video=("<|begin_of_video|>", "<|video|>", "<|end_of_video|>"),
)
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'video' or 'video' in item %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
)
GLM4V_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|observation|>\n{% else %}<|{{ message['role'] }}|>\n{% endif %}"
    + _CONTENT
    + "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _resize(image_processor, height: int, width: int) -> tuple[int, int]:
    """GLM's ``smart_resize``: an image as ``temporal_patch`` frames, bounds on frames x pixels."""
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    min_pixels, max_pixels = size_bounds(image_processor)
    temporal = image_processor.temporal_patch_size
    factor = image_processor.patch_size * image_processor.merge_size
    return smart_resize(
        temporal, height, width, temporal_factor=temporal, factor=factor,
        min_pixels=min_pixels, max_pixels=max_pixels,
    )  # fmt: skip


def _special_ids(tokenizer) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    return {
        "image_token_id": vocab["<|image|>"],
        "video_token_id": vocab["<|video|>"],
        "image_start_token_id": vocab["<|begin_of_image|>"],
        "image_end_token_id": vocab["<|end_of_image|>"],
        "video_start_token_id": vocab["<|begin_of_video|>"],
        "video_end_token_id": vocab["<|end_of_video|>"],
    }


def _tiny_text_config(tokenizer, **extra) -> dict:
    vocab = tokenizer.get_vocab()
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": vocab["<|endoftext|>"],
        "eos_token_id": [vocab["<|endoftext|>"], vocab["<|user|>"], vocab["<|observation|>"]],
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5,
        },
        **extra,
    }  # fmt: skip


def _tiny_vision_config(out_hidden: int) -> dict:
    return {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
        "image_size": 56, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": out_hidden,
    }  # fmt: skip


def _image_processor(min_pixels: int, max_pixels: int):
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    return Glm4vImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )  # fmt: skip


_TINY_BOUNDS = (
    2 * 28 * 28 * 4,
    2 * 28 * 28 * 64,
)  # two frames: the same pictures as Qwen2.5-VL's tiny bounds


def _tiny_glm4v(tokenizer):
    """Tiny GLM-4.1V: hidden 128, 4 heads of 32 channels (16 rotary, adjacent pairs), 2 layers."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    config = Glm4vConfig(
        text_config=_tiny_text_config(tokenizer, hidden_size=128),
        vision_config=_tiny_vision_config(128),
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )
    return Glm4vForConditionalGeneration(config), _image_processor(*_TINY_BOUNDS)


def _tiny_glm4v_moe(tokenizer):
    """Tiny GLM-4.5V: hidden 64, 4 heads of 32 channels (16 rotary, half pairs), a dense and an MoE layer
    (4 routed experts, top 2, one shared)."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    text = _tiny_text_config(
        tokenizer, hidden_size=64, head_dim=32, moe_intermediate_size=32, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    )  # fmt: skip
    config = Glm4vMoeConfig(
        text_config=text,
        vision_config=_tiny_vision_config(64),
        tie_word_embeddings=False,
        **_special_ids(tokenizer),
    )
    return Glm4vMoeForConditionalGeneration(config), _image_processor(*_TINY_BOUNDS)


def _glm_4_1v_9b():
    """GLM-4.1V-9B's published dimensions (the hub's config.json; not checked against the file here: no
    download) and the image bounds of its processor."""
    from transformers import Glm4vConfig

    config = Glm4vConfig(
        text_config={
            "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
            "num_attention_heads": 32, "num_key_value_heads": 2, "max_position_embeddings": 65536,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                "partial_rotary_factor": 0.5,
            },
        },
        vision_config={
            "depth": 24, "hidden_size": 1536, "intermediate_size": 13696, "num_heads": 12, "patch_size": 14,
            "image_size": 336, "out_hidden_size": 4096, "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        image_token_id=151343, video_token_id=151344, image_start_token_id=151339, image_end_token_id=151340,
        video_start_token_id=151341, video_end_token_id=151342,
    )  # fmt: skip
    return config, _image_processor(12_544, 47_040_000)


def _glm_4_5v():
    """GLM-4.5V's published dimensions (106B total, 12B active; the hub's config.json, not checked against the
    file here) and the image bounds of its processor."""
    from transformers import Glm4vMoeConfig

    config, image_processor = _glm_4_1v_9b()
    text = {
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 65536,
        "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5,
        },
    }  # fmt: skip
    moe = Glm4vMoeConfig(
        text_config=text, vision_config=config.vision_config.to_dict(),
        image_token_id=151363, video_token_id=151364, image_start_token_id=151339, image_end_token_id=151340,
        video_start_token_id=151341, video_end_token_id=151342,
    )  # fmt: skip
    return moe, image_processor


GLM4V = Family(
    name="glm4v",
    label="GLM-4.1V",
    model_classes={"glm4v": "Glm4vForConditionalGeneration"},
    rotary_kind="sectioned",
    rotary_pairing="adjacent",
    default_section=(8, 12, 12),
    tokens=_TOKENS,
    end_of_turn="<|user|>",
    special_tokens=GLM_SPECIAL_TOKENS,
    chat_template=GLM4V_TEMPLATE,
    image_processor="transformers.models.glm4v.image_processing_pil_glm4v:Glm4vImageProcessorPil",
    resize=_resize,
    config_token_ids=_special_ids,
    tool_format=None,
    aliases={
        "glm-4.1v-9b-thinking": "zai-org/GLM-4.1V-9B-Thinking",
        "glm-4.1v-9b-base": "zai-org/GLM-4.1V-9B-Base",
    },
    tiny_name="tiny-glm-4.1v",
    build_tiny=_tiny_glm4v,
    references={"glm-4.1v-9b": _glm_4_1v_9b},
)
GLM4V_MOE = dataclasses.replace(
    GLM4V,
    name="glm4v_moe",
    label="GLM-4.5V",
    model_classes={"glm4v_moe": "Glm4vMoeForConditionalGeneration"},
    rotary_pairing="half",
    aliases={"glm-4.5v": "zai-org/GLM-4.5V"},
    tiny_name="tiny-glm-4.5v",
    build_tiny=_tiny_glm4v_moe,
    references={"glm-4.5v": _glm_4_5v},
)
