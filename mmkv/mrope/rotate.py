"""Exact re-rotation of cached (post-RoPE) keys to new M-RoPE positions.

RoPE rotates each channel pair of a key at position ``p`` by the angle ``p * inv_freq[j]`` (the pair is
``(j, j + R/2)`` or ``(2j, 2j + 1)`` by the layout's ``pairing``; channels past the first ``R`` carry no position
and are returned as they are).
Rotations compose, so a key cached at ``p`` is moved to ``p + delta`` by rotating it once more by
``delta * inv_freq[j]``; under M-RoPE, ``delta`` is the shift of the axis (t, h or w) that drives the channel
(see ``layout.py``). Values carry no position and never change.

Under the transformers position rule, moving a still image moves all three axes by the same amount
(``PositionRule``), so ``rerotate(keys, delta=d, ...)`` with an int is exact. A per-axis ``(3,)`` delta or a
per-token ``(3, L)`` delta serves rules that shift axes differently. ``axes=(0,)`` rotates only the temporal
channels: the "temporal-only" variant from the literature, kept for ablation. It is **not** exact under the
transformers rule (the h/w channels stay at their old offset).

Matching the model bit for bit: the model forms each angle as ``float32(p) * inv_freq`` rounded to float32,
an error of up to ``p * 2**-24`` rad that grows with the position (about 1e-5 on a unit key at p = 200).
Given the keys' current positions (``from_positions``, as every ``KVSegment`` passes), the rotation angle is
``fl32((p + delta) * f) - fl32(p * f)``, so the moved key carries exactly the angle the model would have used
at the new position; without them the angle is the exact ``delta * f``. Angles are differenced in float64,
the rotation runs in float32 and the result is cast once to the keys' dtype. One call handles any leading shape, so all layers of a segment
``(layers, B, kv_heads, L, D)`` are re-rotated together with no Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import RotaryLayout

__all__ = ["rerotate", "rotation_tables"]


def _delta_per_token(delta: int | Sequence[int] | torch.Tensor, length: int, device) -> torch.Tensor:
    """Normalise ``delta`` (int, ``(3,)`` or ``(3, L)``) to a ``(3, L)`` float64 tensor on ``device``."""
    d = torch.as_tensor(delta, dtype=torch.float64, device=device)
    if d.ndim == 0:
        d = d.expand(3)
    if d.ndim == 1:
        if d.shape[0] != 3:
            raise ValueError(f"a per-axis delta has three entries (dt, dh, dw), got shape {tuple(d.shape)}")
        d = d[:, None].expand(3, length)
    if d.shape != (3, length):
        raise ValueError(f"a per-token delta must be (3, {length}), got {tuple(d.shape)}")
    return d  # (3, L)


def rotation_tables(
    delta: int | Sequence[int] | torch.Tensor,
    layout: RotaryLayout,
    length: int,
    axes: Sequence[int] = (0, 1, 2),
    device: torch.device | str = "cpu",
    from_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` tables ``(L, R/2)`` (float32), one column per frequency, that rotate ``length`` keys by
    ``delta``.

    Channels driven by an axis not in ``axes`` get angle 0 (identity). With ``from_positions`` ``(3, L)``
    the angles reproduce the model's float32 rounding at both the old and the new position.
    """
    device = torch.device(device)
    math_device = torch.device("cpu") if device.type == "mps" else device  # MPS has no float64
    d = _delta_per_token(delta, length, math_device)  # (3, L) float64
    freq_axes = layout.frequency_axes().to(math_device)  # (D/2,)
    keep = torch.zeros(3, dtype=torch.bool, device=math_device)
    keep[list(axes)] = True
    if from_positions is None:
        inv_freq = layout.inv_freq.to(math_device, torch.float64)  # (D/2,)
        angle = d[freq_axes].T * inv_freq  # (L, D/2) float64, exact delta * f
    else:
        if from_positions.shape != (3, length):
            raise ValueError(f"from_positions must be (3, {length}), got {tuple(from_positions.shape)}")
        inv_freq = layout.inv_freq.to(math_device, torch.float32)  # (D/2,)
        old = from_positions.to(math_device).long()  # (3, L)
        new = old + d.round().long()  # (3, L)
        old_angle = old[freq_axes].T.float() * inv_freq  # (L, D/2) float32, as the model rounds it
        new_angle = new[freq_axes].T.float() * inv_freq  # (L, D/2) float32
        angle = new_angle.double() - old_angle.double()  # (L, D/2) float64, exact difference
    if not bool(keep.all()):
        angle = angle * keep[freq_axes]  # (L, D/2): channels of the other axes keep angle 0
    cos, sin = angle.cos(), angle.sin()  # (L, R/2) each
    return cos.to(device, torch.float32), sin.to(device, torch.float32)


def rerotate(
    keys: torch.Tensor,
    delta: int | Sequence[int] | torch.Tensor,
    layout: RotaryLayout,
    axes: Sequence[int] = (0, 1, 2),
    from_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keys moved by ``delta`` positions: a new tensor of the same shape and dtype; ``keys`` is not changed.

    ``keys``: ``(..., L, D)`` post-RoPE keys, e.g. ``(layers, B, kv_heads, L, D)``.
    ``delta``: int (all axes), ``(3,)`` per axis ``(dt, dh, dw)``, or ``(3, L)`` per token and axis.
    ``axes``: the axes whose channels are rotated; ``(0,)`` is the inexact temporal-only ablation.
    ``from_positions``: ``(3, L)`` current positions of the keys; when given, the result matches the model's
    own float32 angles at the new positions (see the module docstring).
    Raises ``ValueError`` when ``D`` does not match the layout or ``delta`` has the wrong shape.
    """
    if keys.shape[-1] != layout.head_dim:
        raise ValueError(f"keys have head_dim {keys.shape[-1]}, the rotary layout has {layout.head_dim}")
    length = keys.shape[-2]
    cos, sin = rotation_tables(delta, layout, length, axes, keys.device, from_positions)  # (L, R/2) each
    rotary = layout.rotary_dim
    k = keys.float()  # (..., L, D); no copy when keys are already float32
    if layout.pairing == "half":  # pair (j, j + R/2): rotate_half
        first, second = k[..., : rotary // 2], k[..., rotary // 2 : rotary]  # (..., L, R/2) views
    else:  # pair (2j, 2j + 1)
        first, second = k[..., 0:rotary:2], k[..., 1:rotary:2]  # (..., L, R/2) strided views
    new_first = first * cos  # (..., L, R/2)
    new_first.addcmul_(second, sin, value=-1.0)  # first cos - second sin
    new_second = second * cos
    new_second.addcmul_(first, sin)  # second cos + first sin
    out = k.clone() if k is keys else k  # (..., L, D): pass-through channels stay as they are
    if layout.pairing == "half":
        out[..., : rotary // 2], out[..., rotary // 2 : rotary] = new_first, new_second
    else:
        out[..., 0:rotary:2], out[..., 1:rotary:2] = new_first, new_second
    return out.to(keys.dtype)
