"""``rerotate`` against the model's own rotary embedding at shifted positions."""

from __future__ import annotations

import sys

import pytest
import torch

from mmkv.mrope import rerotate
from tests.conftest import family_rotary, real_size_rotaries


def _model_rope(rotary, raw_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys ``(layers, 1, H, L, D)`` rotated by the model's own code at ``positions`` ``(3, L)``: its rotary
    embedding and the ``apply_rotary_pos_emb`` of its modeling module (partial rotary included)."""
    apply_rope = sys.modules[type(rotary).__module__].apply_rotary_pos_emb
    cos, sin = rotary(raw_keys, positions[:, None, :])  # (1, L, R) each
    _, k = apply_rope(raw_keys, raw_keys, cos, sin)  # unsqueeze_dim=1 broadcasts over heads
    return k


@pytest.fixture(params=["tiny", "real"])
def rotary_and_layout(request, tiny):
    """The tiny model's rotary embedding, or a real-size one of its family (its reference config)."""
    if request.param == "tiny":
        return family_rotary(tiny)
    return real_size_rotaries(tiny)[0][1:]


def _check_against_model(rotary, layout, seed: int, max_position: int, model_exact: bool = True) -> float:
    """Largest |rerotate(model_rope(k, p), d) - model_rope(k, p + d)| over random per-axis and per-token d."""
    gen = torch.Generator().manual_seed(seed)
    length = 24
    raw = torch.randn(3, 1, 2, length, layout.head_dim, generator=gen)  # (layers, 1, H, L, D)
    positions = torch.randint(0, max_position // 2, (3, length), generator=gen)  # (3, L)
    cached = _model_rope(rotary, raw, positions)
    worst = 0.0
    span = max_position // 2
    per_axis = torch.randint(-span // 2, span, (3,), generator=gen)
    per_token = torch.randint(-span // 2, span, (3, length), generator=gen)
    for delta in (per_axis, per_token):
        target = (positions + delta.view(3, -1)).clamp(min=0)  # (3, L), non-negative
        delta = target - positions
        if delta.unique(dim=1).shape[1] == 1:
            delta = delta[:, 0]  # one (3,) delta for the whole segment
        expected = _model_rope(rotary, raw, target)
        moved = rerotate(cached, delta, layout, from_positions=positions if model_exact else None)
        worst = max(worst, (moved - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_position", [256, 32768])
def test_per_axis_delta_equals_model_rope_at_shifted_positions(rotary_and_layout, seed, max_position):
    """Random non-uniform (dt, dh, dw), one per segment and one per token, near and far positions:
    with the keys' positions given, max abs <= 1e-5 against the model's own rotary embedding."""
    rotary, layout = rotary_and_layout
    assert _check_against_model(rotary, layout, seed, max_position) <= 1e-5


def test_without_positions_error_is_the_models_own_fp32_rounding(rotary_and_layout):
    """Without the keys' positions the angle is the exact delta * f; the model rounds p * f in fp32 (up to
    p * 2^-24 rad), so at positions up to 32k the gap stays within that floor times the largest key."""
    rotary, layout = rotary_and_layout
    max_position = 32768
    floor = max_position * 2.0**-24 * 4.5  # |k| of unit-normal keys stays below ~4.5
    assert _check_against_model(rotary, layout, 11, max_position, model_exact=False) <= 2 * floor


def test_uniform_shift_is_exact_and_temporal_only_is_not(rotary_and_layout):
    """A uniform shift of 161 matches the model; rotating only the temporal channels is far off."""
    rotary, layout = rotary_and_layout
    gen = torch.Generator().manual_seed(7)
    raw = torch.randn(2, 1, 2, 16, layout.head_dim, generator=gen)
    positions = torch.stack([torch.full((16,), 30), torch.arange(30, 46), torch.arange(30, 46)])  # image-like
    expected = _model_rope(rotary, raw, positions + 161)
    cached = _model_rope(rotary, raw, positions)
    assert (rerotate(cached, 161, layout, from_positions=positions) - expected).abs().max().item() <= 1e-5
    temporal_only = rerotate(cached, 161, layout, axes=(0,), from_positions=positions)
    assert (temporal_only - expected).abs().max().item() > 0.1


def test_zero_delta_is_identity_and_shifts_compose(tiny):
    """delta 0 returns the keys bit for bit; moving by a then b equals moving by a + b (fp32 rounding)."""
    keys = torch.randn(2, 1, 2, 9, tiny.rotary.head_dim, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rerotate(keys, 0, tiny.rotary), keys)
    two_steps = rerotate(rerotate(keys, 40, tiny.rotary), -17, tiny.rotary)
    assert (two_steps - rerotate(keys, 23, tiny.rotary)).abs().max().item() <= 1e-5


def test_batched_over_layers_equals_one_layer_at_a_time_and_keeps_dtype(tiny):
    """One call over (layers, ...) equals per-layer calls; bf16 in gives bf16 out, input untouched."""
    keys = torch.randn(3, 1, 2, 5, tiny.rotary.head_dim).to(torch.bfloat16)
    before = keys.clone()
    moved = rerotate(keys, (3, -2, 7), tiny.rotary)
    assert moved.dtype == torch.bfloat16 and torch.equal(keys, before)
    per_layer = torch.stack([rerotate(k, (3, -2, 7), tiny.rotary) for k in keys])
    assert torch.equal(moved, per_layer)


@pytest.mark.parametrize("bad_delta", [(1, 2), torch.zeros(3, 4)])
def test_bad_delta_shape_raises(tiny, bad_delta):
    """A delta that is neither scalar, (3,) nor (3, L) raises ValueError."""
    with pytest.raises(ValueError):
        rerotate(torch.zeros(1, 1, 1, 5, tiny.rotary.head_dim), bad_delta, tiny.rotary)


def test_wrong_head_dim_raises(tiny):
    """Keys of another head_dim raise ValueError naming both sizes."""
    with pytest.raises(ValueError, match="head_dim"):
        rerotate(torch.zeros(1, 1, 1, 5, tiny.rotary.head_dim + 2), 1, tiny.rotary)
