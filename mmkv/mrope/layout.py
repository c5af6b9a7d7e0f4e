"""Which position axis (t, h or w) drives each rotary channel, and which channels pair up: the M-RoPE layouts.

A head of ``D`` channels rotates its first ``R = 2 * len(inv_freq)`` (``R = D`` for Qwen; GLM-4.xV's
``partial_rotary_factor`` 0.5 gives ``R = D / 2``, the other channels carry no position). Frequency ``j < R/2``
turns one channel pair by ``p * inv_freq[j]``; the **pairing** says which:

- ``"half"`` (Qwen2/2.5/3-VL, GLM-4.5V; ``rotate_half``): pair ``(j, j + R/2)``;
- ``"adjacent"`` (GLM-4.1V; ``rotate_half_llm``): pair ``(2j, 2j + 1)``.

The **kind** says which axis's position id feeds frequency ``j``:

- **sectioned** (Qwen2-VL, Qwen2.5-VL, GLM-4.xV): ``mrope_section = [s_t, s_h, s_w]`` splits the ``R/2``
  frequencies into consecutive blocks. ``[2, 3, 3]`` (R = 16) gives ``T T H H H W W W``.
- **interleaved** (Qwen3-VL): frequency ``j`` is H if ``j % 3 == 1 and j < 3 * s_h``, W if
  ``j % 3 == 2 and j < 3 * s_w``, else T. ``[4, 2, 2]`` (R = 16) gives ``T H W T H W T T``;
  the real ``[24, 20, 20]`` gives ``THW`` x 20 then ``TTTT``.

Qwen3-VL is always interleaved: transformers does not read the config flag ``mrope_interleaved``. Which family
has which layout is the family's knowledge (``mmkv.model.families``), never tested here by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["LayoutKind", "Pairing", "RotaryLayout", "frequency_axes", "rotary_layout_from_config"]

LayoutKind = Literal["sectioned", "interleaved"]
Pairing = Literal["half", "adjacent"]
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
    """The rotary embedding of one model's language side, enough to re-rotate its cached keys.

    ``RotaryLayout("sectioned", (2, 3, 3), inv_freq)`` with 8 frequencies: a head of 16 channels, all rotated,
    pairs ``(j, j + 8)``; ``pairing="adjacent", head_dim=32`` (GLM-4.1V's shape): channels 0-15 rotated in
    pairs ``(0, 1), (2, 3), ...``, channels 16-31 carry no position.
    """

    kind: LayoutKind  # "sectioned" or "interleaved": which axis drives each frequency
    mrope_section: tuple[int, int, int]  # frequencies per axis, sums to rotary_dim / 2
    inv_freq: torch.Tensor = field(repr=False)  # (rotary_dim / 2,) float32, the model's own frequencies
    pairing: Pairing = "half"  # which channels one frequency turns together
    head_dim: int = 0  # channels per head, D (0: all rotary, D = rotary_dim)

    def __post_init__(self) -> None:
        half = int(self.inv_freq.numel())
        if sum(self.mrope_section) != half:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} sums to {sum(self.mrope_section)}, "
                f"but the rotary embedding has rotary_dim / 2 = {half} frequencies; fix the config so they match"
            )
        if self.pairing not in ("half", "adjacent"):
            raise ValueError(f"unknown rotary pairing {self.pairing!r}; expected 'half' or 'adjacent'")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", 2 * half)
        if self.head_dim < 2 * half:
            raise ValueError(f"head_dim {self.head_dim} is smaller than the {2 * half} rotary channels")
        object.__setattr__(self, "_frequency_axes", frequency_axes(self.kind, self.mrope_section))  # cached

    @property
    def rotary_dim(self) -> int:
        """Channels per head that carry a position, ``R`` (the first ``R``)."""
        return 2 * int(self.inv_freq.numel())

    def frequency_axes(self) -> torch.Tensor:
        """``(R/2,)`` axis of each frequency; see ``frequency_axes`` (computed once per layout)."""
        return self._frequency_axes

    def channel_axes(self) -> torch.Tensor:
        """``(R,)`` axis of each rotary channel: under ``"half"`` channels ``c`` and ``c + R/2`` share a
        frequency, under ``"adjacent"`` channels ``2j`` and ``2j + 1``."""
        axes = self.frequency_axes()
        return torch.cat([axes, axes]) if self.pairing == "half" else axes.repeat_interleave(2)  # (R,)


def _default_inv_freq(text_config) -> torch.Tensor:
    """``theta ** (-2j / R)`` in float32, ``R = head_dim * partial_rotary_factor``, as the models'
    ``compute_default_rope_parameters`` does."""
    rope = text_config.rope_parameters
    head_dim = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = rope["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rotary_layout_from_config(
    text_config,
    kind: LayoutKind,
    inv_freq: torch.Tensor | None = None,
    *,
    pairing: Pairing = "half",
    head_dim: int = 0,
    default_section: tuple[int, int, int] | None = None,
) -> RotaryLayout:
    """The layout of a language model from its text config.

    ``inv_freq`` defaults to the model's default RoPE frequencies; pass the model's own buffer
    (``rotary_emb.inv_freq``) to pick up a non-default ``rope_type``. ``head_dim``: the attention's channels
    per head when more than the rotary ones (0: the same). ``default_section``: the model code's section when
    the config has none (default: Qwen's for ``kind``). Raises ``ValueError`` when the section does not fit.
    """
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    if default_section is None:
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
    return RotaryLayout(
        kind=kind,
        mrope_section=section,
        inv_freq=inv_freq.detach().float().cpu(),
        pairing=pairing,
        head_dim=head_dim,
    )
