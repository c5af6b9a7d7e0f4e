"""Tiny random-weight models of the real architectures, for tests: no download, built in well under a second.

``build_tiny("qwen2_5_vl")`` / ``build_tiny("qwen3_vl")`` construct the real transformers classes from the real
config classes, shrunk (2-3 layers, hidden 64, head_dim 16) but keeping what mmkv depends on: grouped-query
attention, the M-RoPE layout of the family (``[2, 3, 3]`` sectioned, ``[4, 2, 2]`` interleaved; both sum to
head_dim / 2), Qwen3-VL's q/k norm and DeepStack on every layer, Qwen2.5-VL's windowed vision attention.

Random initialisation (std 0.02) leaves attention nearly uniform, where positions hardly matter; trained
models attend sharply. So the builder scales every attention score by 4 (q and k by 2 each, through the
q/k norms where the family has them), which makes the tiny models sensitive to positions, as real ones are.

The tokenizer is a byte-level BPE trained here on a fixed corpus (deterministic), carrying the Qwen special
tokens and the family's chat template. Weights come from a fixed seed, so two builds are identical.
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .processor import VLProcessor
from .templates import QWEN2_VL_TEMPLATE, QWEN3_VL_TEMPLATE

__all__ = ["QWEN_SPECIAL_TOKENS", "build_tiny", "train_tokenizer"]

QWEN_SPECIAL_TOKENS = [
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
]

_TINY_CORPUS = """\
You are a helpful assistant. Describe the image. What is in the picture? How many objects are there?
The red circle is left of the blue square. The green triangle is above the yellow star.
Click the submit button. The screenshot shows a login form with a username field and a password field.
Is the badge red or green? Answer with one word. Yes. No. The answer is two. Compare the two images.
user assistant system image screenshot button field policy account role admin verified escalate click
0 1 2 3 4 5 6 7 8 9 left right above below red green blue yellow black white circle square triangle
"""


def train_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus``, Qwen special tokens first (ids 0..13).

    Deterministic for a given corpus and size. ``<|im_end|>`` is the end-of-sequence token and
    ``<|endoftext|>`` the padding token, as in the released Qwen-VL tokenizers.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def _tiny_tokenizer_json() -> str:
    """The tiny tokenizer, serialised once per process (training it takes a few milliseconds)."""
    return train_tokenizer(_TINY_CORPUS.splitlines(), vocab_size=400).backend_tokenizer.to_str()


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    return {
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
    }


def _text_config(tokenizer, mrope_section: list[int], num_layers: int) -> dict:
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


def _build_qwen2_5_vl(tokenizer) -> tuple[PreTrainedModel, VLProcessor]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = _special_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer, [2, 3, 3], num_layers=2),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "out_hidden_size": 64,
        },
        tie_word_embeddings=False,
        **ids,
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 64,
        image_mean=list(OPENAI_CLIP_MEAN),
        image_std=list(OPENAI_CLIP_STD),
    )
    return model, VLProcessor(tokenizer, image_processor, QWEN2_VL_TEMPLATE)


def _build_qwen3_vl(tokenizer) -> tuple[PreTrainedModel, VLProcessor]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = _special_ids(tokenizer)
    config = Qwen3VLConfig(
        text_config=_text_config(tokenizer, [4, 2, 2], num_layers=3),
        vision_config={
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1, 2],
        },
        tie_word_embeddings=False,
        **ids,
    )
    model = Qwen3VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=32 * 32 * 4,
        max_pixels=32 * 32 * 64,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return model, VLProcessor(tokenizer, image_processor, QWEN3_VL_TEMPLATE)


_BUILDERS = {"qwen2_5_vl": _build_qwen2_5_vl, "qwen3_vl": _build_qwen3_vl}
ATTENTION_SHARPNESS = 4.0  # factor on every language-model attention score of a tiny model


@torch.no_grad()
def _sharpen_attention(model: PreTrainedModel, factor: float) -> None:
    """Multiply every LM attention score by ``factor``: q and k by ``sqrt(factor)`` each (in place)."""
    root = factor**0.5
    for layer in model.model.language_model.layers:
        attention = layer.self_attn
        if hasattr(attention, "q_norm"):  # Qwen3: q/k are RMS-normalised after projection
            attention.q_norm.weight.mul_(root)
            attention.k_norm.weight.mul_(root)
            continue
        for proj in (attention.q_proj, attention.k_proj):
            proj.weight.mul_(root)
            if proj.bias is not None:
                proj.bias.mul_(root)


def build_tiny(family: str, seed: int = 0) -> tuple[PreTrainedModel, VLProcessor]:
    """A tiny random-weight model of ``family`` (``"qwen2_5_vl"`` or ``"qwen3_vl"``) and its processor.

    The model is in eval mode, float32, on the CPU, with weights drawn from ``seed``.
    """
    if family not in _BUILDERS:
        raise ValueError(f"no tiny model for family {family!r}; choose one of {sorted(_BUILDERS)}")
    tokenizer = _tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, processor = _BUILDERS[family](tokenizer)
    _sharpen_attention(model, ATTENTION_SHARPNESS)
    return model.eval(), processor
