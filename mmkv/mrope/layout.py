"""Which position axis (t, h or w) drives each rotary channel: the sectioned and interleaved M-RoPE layouts.

Both families rotate channel pairs ``(j, j + D/2)`` (``rotate_half``) with frequency ``inv_freq[j]``,
``j < D/2``. They differ in which axis's position id feeds frequency ``j``:

- **sectioned** (Qwen2-VL, Qwen2.5-VL): ``mrope_section = [s_t, s_h, s_w]`` splits the ``D/2`` frequencies
  into consecutive blocks. ``[2, 3, 3]`` (D = 16) gives ``T T H H H W W W``.
- **interleaved** (Qwen3-VL): frequency ``j`` is H if ``j % 3 == 1 and j < 3 * s_h``, W if
  ``j % 3 == 2 and j < 3 * s_w``, else T. ``[4, 2, 2]`` (D = 16) gives ``T H W T H W T T``;
  the real ``[24, 20, 20]`` gives ``THW`` x 20 then ``TTTT``.

The per-channel axis table has ``D`` entries (the second half repeats the first). Qwen3-VL is always
interleaved: transformers does not read the config flag ``mrope_interleaved``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["RotaryLayout", "frequency_axes", "rotary_layout_from_config"]

LayoutKind = Literal["sectioned", "interleaved"]
AXIS_T, AXIS_H, AXIS_W = 0, 1, 2


def frequency_axes(kind: LayoutKind, mrope_section: tuple[int, int, int]) -> torch.Tensor:
    """The axis (0 = t, 1 = h, 2 = w) of each of the ``sum(mrope_section)`` frequencies, as ``(D/2,)`` long.

    ``frequency_axes("sectioned", (2, 3, 3))`` -> ``[0, 0, 1, 1, 1, 2, 2, 2]``;
    ``frequency_axes("interleaved", (4, 2, 2))`` -> ``[0, 1, 2, 0, 1, 2, 0, 0]``.
    """
    s_t, s_h, s_w = (int(s) for s in mrope_section)
    half = s_t + s_h + s_w
    if kind == "sectioned":
        return torch.tensor([AXIS_T] * s_t + [AXIS_H] * s_h + [AXIS_W] * s_w, dtype=torch.long)
    if kind == "interleaved":
        axes = torch.full((half,), AXIS_T, dtype=torch.long)  # (D/2,)
        j = torch.arange(half)
        axes[(j % 3 == 1) & (j < 3 * s_h)] = AXIS_H
        axes[(j % 3 == 2) & (j < 3 * s_w)] = AXIS_W
        return axes
    raise ValueError(f"unknown rotary layout {kind!r}; expected 'sectioned' or 'interleaved'")


@dataclass(frozen=True)
class RotaryLayout:
    """The rotary embedding of one model's language side, enough to re-rotate its cached keys."""

    kind: LayoutKind  # "sectioned" (Qwen2/2.5-VL) or "interleaved" (Qwen3-VL)
    mrope_section: tuple[int, int, int]  # frequencies per axis, sums to head_dim / 2
    inv_freq: torch.Tensor = field(repr=False)  # (head_dim / 2,) float32, the model's own frequencies

    def __post_init__(self) -> None:
        half = int(self.inv_freq.numel())
        if sum(self.mrope_section) != half:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} sums to {sum(self.mrope_section)}, "
                f"but the rotary embedding has head_dim / 2 = {half} frequencies; fix the config so they match"
            )
        object.__setattr__(self, "_frequency_axes", frequency_axes(self.kind, self.mrope_section))  # cached

    @property
    def head_dim(self) -> int:
        """Channels per head, ``D``."""
        return 2 * int(self.inv_freq.numel())

    def frequency_axes(self) -> torch.Tensor:
        """``(D/2,)`` axis of each frequency; see ``frequency_axes`` (computed once per layout)."""
        return self._frequency_axes

    def channel_axes(self) -> torch.Tensor:
        """``(D,)`` axis of each rotary channel (channel ``c`` and ``c + D/2`` share a frequency)."""
        axes = self.frequency_axes()
        return torch.cat([axes, axes])  # (D,)


def _default_inv_freq(text_config) -> torch.Tensor:
    """``theta ** (-2j / D)`` in float32, as the models' ``compute_default_rope_parameters`` does."""
    rope = text_config.rope_parameters
    head_dim = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    base = rope["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rotary_layout_from_config(
    text_config, kind: LayoutKind, inv_freq: torch.Tensor | None = None
) -> RotaryLayout:
    """The layout of a language model from its text config.

    ``inv_freq`` defaults to the model's default RoPE frequencies; pass the model's own buffer
    (``rotary_emb.inv_freq``) to pick up a non-default ``rope_type``. Raises ``ValueError`` when the config
    has no ``mrope_section`` or it does not fit ``head_dim``.
    """
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    default_section = {"sectioned": (16, 24, 24), "interleaved": (24, 20, 20)}[kind]
    section = tuple(int(s) for s in rope.get("mrope_section", default_section))
    if len(section) != 3:
        raise ValueError(f"mrope_section must have three entries (t, h, w), got {section}")
    if inv_freq is None:
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_type {rope.get('rope_type')!r} needs the model's own inv_freq; pass inv_freq="
            )
        inv_freq = _default_inv_freq(text_config)
    return RotaryLayout(kind=kind, mrope_section=section, inv_freq=inv_freq.detach().float().cpu())
