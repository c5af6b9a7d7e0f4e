"""Tiny random-weight models of the real architectures, for tests: no download, built in well under a second.

``build_tiny("qwen3_vl")`` builds the family's tiny model (its ``Family.build_tiny``: the real transformers
classes from the real config classes, shrunk) with a tokenizer carrying the family's special tokens and its
chat template, and wraps it with the family's processor.

Random initialisation (std 0.02) leaves attention nearly uniform, where positions hardly matter; trained
models attend sharply. So the builder scales every attention score by 4 (q and k by 2 each, through the
q/k norms where the family has them), which makes the tiny models sensitive to positions, as real ones are.

The tokenizer is a byte-level BPE trained here on a fixed corpus (deterministic), the family's special tokens
first (ids 0..n-1). Weights come from a fixed seed, so two builds are identical.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from .families import family_named
from .families.qwen_vl import QWEN_SPECIAL_TOKENS
from .processor import VLProcessor

__all__ = ["ATTENTION_SHARPNESS", "build_tiny", "train_tokenizer"]

_TINY_CORPUS = """\
You are a helpful assistant. Describe the image. What is in the picture? How many objects are there?
The red circle is left of the blue square. The green triangle is above the yellow star.
Click the submit button. The screenshot shows a login form with a username field and a password field.
Is the badge red or green? Answer with one word. Yes. No. The answer is two. Compare the two images.
user assistant system image screenshot button field policy account role admin verified escalate click
0 1 2 3 4 5 6 7 8 9 left right above below red green blue yellow black white circle square triangle
"""


def train_tokenizer(
    corpus: list[str],
    vocab_size: int,
    special_tokens: Sequence[str] = QWEN_SPECIAL_TOKENS,
    eos_token: str = "<|im_end|>",
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus``, ``special_tokens`` first (ids 0..n-1).

    Deterministic for a given corpus and size. ``eos_token`` (one of ``special_tokens``: another would be added
    to the vocabulary) ends an answer and the first special token pads (for Qwen ``<|im_end|>`` and
    ``<|endoftext|>``, as in the released Qwen-VL tokenizers).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if eos_token not in special_tokens:
        raise ValueError(f"eos_token {eos_token!r} is not one of the special tokens")
    tok.train_from_iterator(corpus, trainer)
    return _wrap(tok, special_tokens, eos_token)


def _wrap(tok: Tokenizer, special_tokens: Sequence[str], eos_token: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=special_tokens[0],
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def _tiny_tokenizer_json(special_tokens: tuple[str, ...], eos_token: str) -> str:
    """The tiny tokenizer of a family's special tokens, serialised once per process (training takes ms)."""
    corpus = _TINY_CORPUS.splitlines()
    return train_tokenizer(corpus, 400, special_tokens, eos_token).backend_tokenizer.to_str()


def tiny_tokenizer(family_name: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer of family ``family_name``: its special tokens first, answers ending at its end of turn."""
    family = family_named(family_name)
    tok = Tokenizer.from_str(_tiny_tokenizer_json(family.special_tokens, family.end_of_turn))
    return _wrap(tok, family.special_tokens, family.end_of_turn)


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


def build_tiny(family_name: str, seed: int = 0) -> tuple[PreTrainedModel, VLProcessor]:
    """A tiny random-weight model of the family ``family_name`` (e.g. ``"qwen3_vl"``) and its processor.

    The model is in eval mode, float32, on the CPU, with weights drawn from ``seed``.
    """
    try:
        family = family_named(family_name)
    except KeyError:
        family = None
    if family is None or family.build_tiny is None:
        raise ValueError(f"no tiny model for family {family_name!r}")
    tokenizer = tiny_tokenizer(family.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, image_processor = family.build_tiny(tokenizer)
    _sharpen_attention(model, ATTENTION_SHARPNESS)
    return model.eval(), VLProcessor(tokenizer, image_processor, family.chat_template, family)
