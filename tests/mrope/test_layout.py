"""The channel layout against the models' own rotary embedding, tiny and real-size configs."""

from __future__ import annotations

import pytest
import torch

from mmkv.mrope import RotaryLayout, frequency_axes
from tests.conftest import family_rotary, real_size_rotaries


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


def _axes_driving_each_channel(rotary, layout) -> torch.Tensor:
    """Probe a model's rotary embedding: feed t, h, w positions 100, 200, 300 and see which drives each rotary
    channel (sin, which stays distinguishable at the lowest frequencies), given each channel's frequency."""
    probe = torch.tensor([100, 200, 300]).view(3, 1, 1)  # (3, B=1, L=1)
    _, sin = rotary(torch.zeros(1, 1, layout.head_dim), probe)  # (1, 1, R)
    per_channel = rotary.inv_freq.repeat(2) if layout.pairing == "half" else rotary.inv_freq.repeat_interleave(2)
    candidates = torch.stack([torch.sin(p * per_channel) for p in (100.0, 200.0, 300.0)])  # (3, R)
    return (sin[0, 0][None] - candidates).abs().argmin(0)  # (R,)


def test_channel_axes_match_real_size_rotary(tiny):
    """At real sizes (head_dim 128) our channel->axis table equals what the model's rotary embedding does."""
    for arch, rotary, layout in real_size_rotaries(tiny):
        assert torch.equal(layout.inv_freq, rotary.inv_freq), arch
        assert torch.equal(_axes_driving_each_channel(rotary, layout), layout.channel_axes()), arch


def test_channel_axes_match_tiny_models(tiny):
    """For the tiny models too (sections [2, 3, 3] and [4, 2, 2]; GLM's adjacent pairs and half rotary)."""
    rotary, layout = family_rotary(tiny)
    assert torch.equal(_axes_driving_each_channel(rotary, layout), layout.channel_axes())
