"""The channel layout against the models' own rotary embedding, tiny and real-size configs."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from mmkv.model.reference import reference_config
from mmkv.mrope import RotaryLayout, frequency_axes, rotary_layout_from_config


def test_frequency_axes_examples():
    """The documented small examples of both layouts."""
    assert frequency_axes("sectioned", (2, 3, 3)).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert frequency_axes("interleaved", (4, 2, 2)).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


def test_real_interleaved_pattern_is_thw_times_20_then_tttt():
    """Qwen3-VL's [24, 20, 20]: THW repeated 20 times, then TTTT."""
    letters = "".join("THW"[a] for a in frequency_axes("interleaved", (24, 20, 20)).tolist())
    assert letters == "THW" * 20 + "TTTT"


def test_mismatched_section_raises():
    """mrope_section must sum to head_dim / 2."""
    with pytest.raises(ValueError, match="sums to"):
        RotaryLayout("sectioned", (16, 24, 24), torch.ones(32))


def _axes_driving_each_channel(rotary, head_dim: int) -> torch.Tensor:
    """Probe a model's rotary embedding: feed t, h, w positions 100, 200, 300 and see which drives each channel
    (sin, which stays distinguishable at the lowest frequencies)."""
    probe = torch.tensor([100, 200, 300]).view(3, 1, 1)  # (3, B=1, L=1)
    _, sin = rotary(torch.zeros(1, 1, head_dim), probe)  # (1, 1, D)
    candidates = torch.stack(
        [torch.sin(p * rotary.inv_freq.repeat(2)) for p in (100.0, 200.0, 300.0)]
    )  # (3, D)
    return (sin[0, 0][None] - candidates).abs().argmin(0)  # (D,)


def _real_configs():
    """(layout kind, text config, rotary class) of Qwen2.5-VL-7B and Qwen3-VL-8B."""
    return [
        ("sectioned", reference_config("qwen2.5-vl-7b").text_config, Qwen2_5_VLRotaryEmbedding),
        ("interleaved", reference_config("qwen3-vl-8b").text_config, Qwen3VLTextRotaryEmbedding),
    ]


@pytest.mark.parametrize("kind,config,rotary_class", _real_configs(), ids=["qwen2.5-vl-7b", "qwen3-vl-8b"])
def test_channel_axes_match_real_size_rotary(kind, config, rotary_class):
    """At real sizes (head_dim 128) our channel->axis table equals what the model's rotary embedding does."""
    layout = rotary_layout_from_config(config, kind)
    rotary = rotary_class(config)
    assert torch.equal(layout.inv_freq, rotary.inv_freq)
    assert torch.equal(_axes_driving_each_channel(rotary, layout.head_dim), layout.channel_axes())


def test_channel_axes_match_tiny_models(tiny):
    """For the tiny models too (sections [2, 3, 3] and [4, 2, 2])."""
    rotary = tiny.model.model.language_model.rotary_emb
    assert torch.equal(_axes_driving_each_channel(rotary, tiny.rotary.head_dim), tiny.rotary.channel_axes())
