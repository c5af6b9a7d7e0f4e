"""``KVSegment``: the language-model KV of one contiguous token span, the record images and text share.

A segment holds, for every decoder layer, the post-RoPE keys and the values of its tokens, plus the token ids
and the ``(3, L)`` M-RoPE position ids they were computed at. ``moved_to(start)`` re-rotates the keys so the
segment can be spliced at another position; values never change. Segments go into a transformers
``DynamicCache`` (``segments_to_cache``) and come out of one (``segment_from_cache``).

Positions and cache indices are decoupled: a segment's tokens occupy ``length`` cache entries but
``num_slots`` positions (an image of LLM grid ``h' x w'`` plus its two markers occupies ``max(h', w') + 2``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from transformers import DynamicCache

from ..mrope import RotaryLayout, rerotate

__all__ = [
    "KVSegment",
    "SegmentKind",
    "append_to_cache",
    "segment_from_cache",
    "segments_to_cache",
    "stack_cache",
]

SegmentKind = Literal["text", "image"]


@dataclass(frozen=True, eq=False)
class KVSegment:
    """KV of a contiguous span of tokens. Immutable: operations return new segments."""

    keys: torch.Tensor  # (layers, 1, kv_heads, L, D) post-RoPE keys, model dtype and device
    values: torch.Tensor  # (layers, 1, kv_heads, L, D) values
    token_ids: torch.Tensor  # (L,) long, CPU
    position_ids: torch.Tensor  # (3, L) long, CPU: (t, h, w) of each token
    kind: SegmentKind  # "image" if the span holds image pads, else "text"
    digest: str  # content digest of what the span encodes (image or text); "" if unnamed
    rotary: RotaryLayout = field(repr=False)  # rotary channel layout the keys were rotated with

    def __post_init__(self) -> None:
        length = self.token_ids.shape[0]
        if length == 0:
            raise ValueError("a KVSegment cannot be empty")
        if self.keys.ndim != 5 or self.keys.shape != self.values.shape:
            raise ValueError(
                f"keys and values must both be (layers, 1, kv_heads, L, D); got {tuple(self.keys.shape)} "
                f"and {tuple(self.values.shape)}"
            )
        if self.keys.shape[3] != length or self.position_ids.shape != (3, length):
            raise ValueError(
                f"segment of {length} tokens has keys for {self.keys.shape[3]} and positions "
                f"{tuple(self.position_ids.shape)}"
            )

    @property
    def length(self) -> int:
        """Tokens (cache entries) in the segment."""
        return int(self.token_ids.shape[0])

    @property
    def start(self) -> int:
        """Temporal position of the first token: where the segment begins in position space."""
        return int(self.position_ids[0, 0])

    @property
    def num_slots(self) -> int:
        """Position slots the segment occupies: ``max position + 1 - start``."""
        return int(self.position_ids.max()) + 1 - self.start

    @property
    def end(self) -> int:
        """The position of the token that follows the segment: ``start + num_slots``."""
        return self.start + self.num_slots

    @property
    def num_layers(self) -> int:
        """Decoder layers covered."""
        return int(self.keys.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (ids and positions excluded)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def moved_to(self, start: int, axes: Sequence[int] = (0, 1, 2)) -> KVSegment:
        """A copy whose keys are re-rotated so that its first token sits at position ``start``.

        Every axis of every token moves by ``start - self.start`` (the transformers rule); ``axes=(0,)`` gives
        the inexact temporal-only ablation (position ids are then still reported as fully moved).
        """
        delta = start - self.start
        if delta == 0 and tuple(axes) == (0, 1, 2):
            return self
        return replace(
            self,
            keys=rerotate(self.keys, delta, self.rotary, axes=axes, from_positions=self.position_ids),
            position_ids=self.position_ids + delta,
        )

    def slice(self, begin: int, end: int | None = None, copy: bool = False) -> KVSegment:
        """Tokens ``[begin, end)`` as a segment: views of this one's tensors, or copies with ``copy=True``
        (so that holding the slice does not keep the whole tensor alive)."""
        keys, values = self.keys[:, :, :, begin:end], self.values[:, :, :, begin:end]
        if copy:
            keys, values = keys.clone(), values.clone()
        if keys.shape[3] == 0:
            raise ValueError("a KVSegment cannot be empty")
        out = object.__new__(type(self))  # a slice of a valid segment is valid: skip re-checking its shapes
        out.__dict__.update(self.__dict__)
        out.__dict__.update(
            keys=keys,
            values=values,
            token_ids=self.token_ids[begin:end],
            position_ids=self.position_ids[:, begin:end],
        )
        return out

    def to(self, device: torch.device | str) -> KVSegment:
        """The same segment with K and V on ``device``."""
        return replace(self, keys=self.keys.to(device), values=self.values.to(device))

    @staticmethod
    def concat(segments: Sequence[KVSegment], digest: str = "") -> KVSegment:
        """One segment spanning ``segments`` in order (kind "image" if any part is an image)."""
        if not segments:
            raise ValueError("nothing to concatenate")
        kind: SegmentKind = "image" if any(s.kind == "image" for s in segments) else "text"
        return KVSegment(
            keys=torch.cat([s.keys for s in segments], dim=3),
            values=torch.cat([s.values for s in segments], dim=3),
            token_ids=torch.cat([s.token_ids for s in segments]),
            position_ids=torch.cat([s.position_ids for s in segments], dim=1),
            kind=kind,
            digest=digest,
            rotary=segments[0].rotary,
        )


def stack_cache(
    cache: DynamicCache, begin: int = 0, end: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of cache entries ``[begin, end)`` of every layer, stacked: two ``(layers, B, H, L, D)``
    tensors (copies: later cache updates do not change them)."""
    keys = torch.stack([layer.keys[:, :, begin:end] for layer in cache.layers])  # (layers, B, H, L, D)
    values = torch.stack([layer.values[:, :, begin:end] for layer in cache.layers])  # (layers, B, H, L, D)
    return keys, values


def segment_from_cache(
    cache: DynamicCache,
    begin: int,
    token_ids: torch.Tensor,
    position_ids: torch.Tensor,
    rotary: RotaryLayout,
    kind: SegmentKind = "text",
    digest: str = "",
) -> KVSegment:
    """The segment stored at cache entries ``[begin, begin + len(token_ids))``. Does not change ``cache``."""
    keys, values = stack_cache(cache, begin, begin + token_ids.shape[0])
    return KVSegment(keys, values, token_ids.cpu(), position_ids.cpu(), kind, digest, rotary)


def append_to_cache(cache: DynamicCache, segment: KVSegment) -> None:
    """Append ``segment``'s K and V to every layer of ``cache`` (mutates ``cache``; one update per layer)."""
    for layer_idx in range(segment.num_layers):
        cache.update(segment.keys[layer_idx], segment.values[layer_idx], layer_idx)


def reorder_cache(cache: DynamicCache, begin: int, order: torch.Tensor) -> None:
    """Permute the entries from ``begin`` on, in every layer: entry ``begin + i`` becomes the old
    ``begin + order[i]`` (mutates ``cache`` in place; the entries before ``begin`` are not copied or touched)."""
    for layer in cache.layers:
        index = order.to(layer.keys.device)
        layer.keys[:, :, begin:] = layer.keys[:, :, begin:].index_select(2, index)
        layer.values[:, :, begin:] = layer.values[:, :, begin:].index_select(2, index)


def segments_to_cache(segments: Sequence[KVSegment], config=None) -> DynamicCache:
    """A new ``DynamicCache`` holding ``segments`` back to back, in order (one concatenation per layer).

    Positions are whatever the segments carry: move them first (``moved_to``) so they tile without gaps.
    """
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    if not segments:
        return cache
    append_to_cache(cache, KVSegment.concat(segments) if len(segments) > 1 else segments[0])
    return cache
