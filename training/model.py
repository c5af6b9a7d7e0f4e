"""The small checkpoints' architecture, tokenizer, image bounds and chat template, fresh or carried on.

``build_model`` makes a fresh small model of a family (the real transformers classes shrunk to a few million
parameters, a byte-level BPE tokenizer of 700 tokens trained on the suite's texts, the family's chat template).
``load_for_training`` continues a saved checkpoint (``--init``) and brings what is not weights up to date: the
chat template that renders tools (``mmkv/model/templates.py``), the image bounds below and the tool tokens.

Tool tokens: the 700-token BPE was trained on the suite's prose and splits the tools block into about 1.6
characters per token (an 880-token system message; 55 tokens per tool call). ``TOOL_TOKENS`` are added to it as
ordinary (non-special) added tokens, every existing id unchanged: the hermes tags, which the released Qwen2.5-VL
/ Qwen3-VL tokenizers also hold as single added tokens (``<tool_call>`` 151657, ``</tool_call>`` 151658,
``<tool_response>`` 151665, ``</tool_response>`` 151666), ``<tools>`` / ``</tools>``, and the quoted JSON keys
and values of the desktop's tool specs (what a large BPE holds as merges). The system message falls to 570
tokens and a tool call to 22. A new token's embedding starts as the mean of the embeddings of the pieces it
replaces, so a continued model reads it as it read those pieces; none of them occurs in the suite's texts.

Image bounds: the suite's and the desktop's 256 x 256 px pictures are 64 language-model tokens in both
families: Qwen3-VL (patch 16, merge 2) keeps them at 256 px (8 x 8 tokens of 32 px; at most 65,536 px per
image), Qwen2.5-VL (patch 14, merge 2) resizes them to 224 px (8 x 8 tokens of 28 px; at most 50,176 px).
Changing the bounds changes image digests (the processor settings are part of them): stores of the old
checkpoints do not hit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmkv
from evals.pictures import SHAPES
from evals.tasks import AGENTIC_POLICY, TRAINING_CATEGORIES, make_samples
from mmkv.model.families import family_named
from mmkv.model.handle import ModelHandle
from mmkv.model.processor import VLProcessor
from mmkv.model.tiny import train_tokenizer
from mmkv.synthetic import COLOURS

__all__ = [
    "IMAGE_BOUNDS",
    "OUT_NAMES",
    "TEMPLATES",
    "build_model",
    "load_for_training",
    "with_current_processor",
]

OUT_NAMES = {"qwen3_vl": "small-qwen3-vl", "qwen2_5_vl": "small-qwen2.5-vl"}
TEMPLATES = {name: family_named(name).chat_template for name in OUT_NAMES}
IMAGE_BOUNDS = {  # (min_pixels, max_pixels): see the module docstring
    "qwen3_vl": (32 * 32 * 4, 256 * 256),
    "qwen2_5_vl": (28 * 28 * 4, 224 * 224),
}


TOOL_TOKENS = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>",
    '"type"', '"function"', '"name"', '"description"', '"parameters"', '"object"', '"properties"', '"string"',
    '"enum"', '"required"', '"arguments"', '"target"', '"field"', '"text"', '"item"', '"note"', '"ticket"',
    '"approve"', '"submit"', '"ok"', '"close"', '"click"', '"fill"', '"escalate"', '"admin"', '"viewer"',
)  # fmt: skip


def _corpus() -> list[str]:
    """Texts the tokenizer is trained on: everything the suite and the chat template can say (a fresh model
    only; a continued one keeps its tokenizer)."""
    words = [*COLOURS, *SHAPES, "yes", "no", "first", "second", "same", "admin", "viewer"]
    lines = [AGENTIC_POLICY.format(role=r) for r in ("admin", "viewer")]
    for category in TRAINING_CATEGORIES:
        for sample in make_samples(category, 300, seed=123, split="train"):
            lines += [sample.question, sample.answer, *(t.text for t in sample.turns)]
    lines += ["system user assistant", "You are a helpful assistant.", " ".join(words)]
    lines += [f"click(approve) escalate(ticket) click(submit) fill(field) Screen {i}." for i in range(1, 7)]
    return lines


def _image_processor(family: str) -> Qwen2VLImageProcessorPil:
    min_pixels, max_pixels = IMAGE_BOUNDS[family]
    if family == "qwen3_vl":
        return Qwen2VLImageProcessorPil(
            patch_size=16, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels,
            image_mean=[0.5] * 3, image_std=[0.5] * 3,
        )  # fmt: skip
    return Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD),
    )  # fmt: skip


def build_model(family: str, seed: int = 0) -> ModelHandle:
    """A fresh small model of ``family`` with its tokenizer, image processor and chat template."""
    tokenizer = train_tokenizer(_corpus(), vocab_size=700)
    vocab = tokenizer.get_vocab()
    ids = {
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
    }
    text = {
        "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
        "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    }  # fmt: skip
    vision = {
        "depth": 4, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "out_hidden_size": 128,
    }  # fmt: skip
    torch.manual_seed(seed)
    if family == "qwen3_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]}
        vision |= {"patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [1, 3]}
        config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        model = Qwen3VLForConditionalGeneration(config)
    else:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
        vision |= {"patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1, 3]}
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        model = Qwen2_5_VLForConditionalGeneration(config)
    add_tool_tokens(tokenizer, model)
    processor = VLProcessor(tokenizer, _image_processor(family), TEMPLATES[family], family_named(family))
    return ModelHandle.from_parts(OUT_NAMES[family], model.eval(), processor, family_named(family))


def add_tool_tokens(tokenizer, model) -> int:
    """Add the missing ``TOOL_TOKENS`` to ``tokenizer`` (ordinary added tokens: existing ids unchanged) and grow
    ``model``'s embeddings (and its head, when not tied) to match, each new row the mean of the rows of the
    pieces the token replaces.
    Changes both in place; returns how many tokens were added."""
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    missing = [t for t in TOOL_TOKENS if t not in vocab]
    if not missing:
        return 0
    pieces = {t: tokenizer(t, add_special_tokens=False)["input_ids"] for t in missing}  # before adding
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in missing])
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    tables = [model.get_input_embeddings().weight]  # (vocab, hidden); the head too when it is not tied
    head = model.get_output_embeddings().weight
    if head.data_ptr() != tables[0].data_ptr():
        tables.append(head)
    with torch.no_grad():
        for token, ids in pieces.items():
            for table in tables:
                table[tokenizer.convert_tokens_to_ids(token)] = table[ids].mean(0)
    return len(missing)


def with_current_processor(handle: ModelHandle) -> ModelHandle:
    """``handle`` with its weights, but this module's chat template (tools), image bounds and tool tokens (the
    tokenizer and the embeddings grown in place)."""
    family = handle.family.name
    add_tool_tokens(handle.processor.tokenizer, handle.model)
    processor = VLProcessor(
        handle.processor.tokenizer, _image_processor(family), TEMPLATES[family], handle.family
    )
    return ModelHandle.from_parts(handle.name, handle.model, processor, handle.family)


def load_for_training(init: Path, device: str = "cpu") -> ModelHandle:
    """The checkpoint ``init`` (its weights and tokenizer), with the current template and image bounds."""
    handle = mmkv.load(init, device=device)
    if handle.family.name not in OUT_NAMES:
        raise ValueError(f"{init} is a {handle.family.name} checkpoint; training knows {sorted(OUT_NAMES)}")
    return with_current_processor(handle)
