"""``SegmentPatch``: a small stored correction of a cached segment's KV, in the spirit of Kamera (arXiv 2606.23581):
what the segment's keys and values gain, on average, from the context they are spliced after, as a low-rank
delta per layer; and ``PatchStore``, where patches are kept (a ``TieredStore`` of their own records).

A segment computed in one context and spliced after another keeps the attention it took where it was computed.
Part of what it misses is shared by the contexts it is used in (a long preamble before it, whatever its words).
``fit_patch`` measures that part: the segment's KV as computed after each of several calibration contexts
(``observed``, e.g. ``mmkv.text.precompile(..., preamble=opening + context)``), minus the cached KV re-rotated to
the same positions, averaged over the contexts, each layer's ``(tokens, kv_heads * head_dim)`` matrix cut to its
top ``rank`` singular directions. ``patch.apply(segment)`` adds it (keys in the segment's own position frame, so
the splice re-rotates keys and correction together: rotation is linear). Pure math, no model: the caller computes
the observed segments. Example::

    stored = mmkv.text.precompile(model, policy, preamble=opening)
    seen = [mmkv.text.precompile(model, policy, preamble=opening + text) for text in calibration_texts]
    patch = fit_patch(stored, seen, rank=4)           # 4 x (tokens + kv_heads * head_dim) floats per layer, K and V
    patches.put(stored.digest, patch, model)           # a PatchStore, beside the KVStore
    session.add_segment(patch.apply(stored), seam=1)   # spliced as usual, corrected

A patch fitted on the context a segment is used in makes that use exact at full rank; its worth is in contexts it
was not fitted on (``evals/compose.py``'s ``patch`` arms fit on preamble styles other than the one they test).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ..cache.codec import CorruptEntryError, payload_checksum
from ..cache.store import StoreCodec, TieredStore
from ..kv.segment import KVSegment

__all__ = ["PatchStore", "SegmentPatch", "decode_patch", "encode_patch", "fit_patch"]

_NAMES = ("key_left", "key_right", "value_left", "value_right")
_FORMAT = 1  # the patch record's version


@dataclass(frozen=True, eq=False)
class SegmentPatch:
    """A low-rank delta of one segment's keys and values: ``delta[l] = left[l] @ right[l]`` per layer, reshaped to
    ``(kv_heads, tokens, head_dim)``. Keys are in the segment's own position frame. Immutable."""

    digest: str  # the digest of the segment it corrects
    key_left: torch.Tensor  # (layers, L, r) float32
    key_right: torch.Tensor  # (layers, r, kv_heads * D) float32
    value_left: torch.Tensor  # (layers, L, r) float32
    value_right: torch.Tensor  # (layers, r, kv_heads * D) float32
    num_contexts: int  # calibration contexts averaged

    def __post_init__(self) -> None:
        layers, length, rank = self.key_left.shape
        width = self.key_right.shape[-1]
        for left, right in ((self.key_left, self.key_right), (self.value_left, self.value_right)):
            if left.shape != (layers, length, rank) or right.shape != (layers, rank, width):
                raise ValueError(f"patch factors do not fit: {tuple(left.shape)} and {tuple(right.shape)}")
        if self.num_contexts < 1:
            raise ValueError("a patch averages at least one context")

    @property
    def rank(self) -> int:
        """Singular directions kept per layer."""
        return int(self.key_left.shape[-1])

    @property
    def length(self) -> int:
        """Tokens of the segment it corrects."""
        return int(self.key_left.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes its factors hold."""
        return sum(getattr(self, name).numel() * 4 for name in _NAMES)

    def apply(self, segment: KVSegment) -> KVSegment:
        """``segment`` with the delta added (same type, positions and digest; its dtype kept). ``ValueError`` for a
        segment of another digest or shape. Changes nothing."""
        layers, _, heads, length, dim = segment.keys.shape
        if segment.digest != self.digest or (layers, length) != tuple(self.key_left.shape[:2]):
            raise ValueError(f"this patch is for segment {self.digest[:16]}... of {self.length} tokens")
        if heads * dim != self.key_right.shape[-1]:
            raise ValueError(
                f"this patch is for {self.key_right.shape[-1]} channels per token, not {heads * dim}"
            )

        def delta(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            flat = left.to(segment.keys.device) @ right.to(segment.keys.device)  # (layers, L, H * D)
            return flat.reshape(layers, length, heads, dim).permute(0, 2, 1, 3)[
                :, None
            ]  # (layers, 1, H, L, D)

        keys = (segment.keys.float() + delta(self.key_left, self.key_right)).to(segment.keys.dtype)
        values = (segment.values.float() + delta(self.value_left, self.value_right)).to(segment.values.dtype)
        return replace(segment, keys=keys, values=values)


def fit_patch(segment: KVSegment, observed: Sequence[KVSegment], rank: int) -> SegmentPatch:
    """The patch that moves ``segment`` (the cached KV) toward ``observed`` (its KV as computed after each
    calibration context: the same tokens, anywhere): the mean delta over them, in ``segment``'s position frame,
    cut to ``rank`` per layer (``rank`` >= tokens or channels keeps it whole). ``ValueError`` for an observation of
    other tokens or shape, an empty list, or ``rank < 1``. Pure."""
    if not observed:
        raise ValueError("fit_patch needs at least one observed segment")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    sum_k = torch.zeros(segment.keys.shape, dtype=torch.float32, device=segment.keys.device)
    sum_v = torch.zeros_like(sum_k)
    for seen in observed:
        if not torch.equal(seen.token_ids, segment.token_ids) or seen.keys.shape != segment.keys.shape:
            raise ValueError("an observed segment holds other tokens or another shape than the segment")
        moved = segment.moved_to(seen.start)  # the cached KV where this one was computed
        dk = replace(seen, keys=seen.keys.float() - moved.keys.float()).moved_to(
            segment.start
        )  # back to our frame
        sum_k += dk.keys.float()
        sum_v += seen.values.float() - segment.values.float()
    layers, _, heads, length, dim = segment.keys.shape
    factors = []
    for total in (sum_k, sum_v):
        mean = (total / len(observed))[:, 0].permute(0, 2, 1, 3).reshape(layers, length, heads * dim).cpu()
        u, s, vh = torch.linalg.svd(
            mean, full_matrices=False
        )  # (layers, L, k), (layers, k), (layers, k, H * D)
        keep = min(rank, s.shape[-1])
        factors += [(u[..., :keep] * s[:, None, :keep]).contiguous(), vh[:, :keep].contiguous()]
    return SegmentPatch(segment.digest, *factors, num_contexts=len(observed))


# ------------------------------------------------------------------------------------------------ the store
def encode_patch(patch: SegmentPatch, fingerprint: str) -> bytes:
    """Record bytes (safetensors, JSON header with version, kind, fingerprint, digest, checksum) of ``patch``."""
    tensors = {name: getattr(patch, name).detach().cpu().contiguous() for name in _NAMES}
    meta = {"format": _FORMAT, "kind": "patch", "fingerprint": fingerprint, "digest": patch.digest,
            "num_contexts": patch.num_contexts, "checksum": payload_checksum(tensors)}  # fmt: skip
    return _st_save(tensors, metadata={"mmkv": json.dumps(meta, sort_keys=True)})


def decode_patch(data: bytes, fingerprint: str, digest: str) -> SegmentPatch:
    """The ``SegmentPatch`` in ``data``, after every check; ``CorruptEntryError`` when one fails."""
    try:
        tensors = _st_load(bytes(data))
        header = json.loads(bytes(data[8 : 8 + int.from_bytes(bytes(data[:8]), "little")]))
        meta = json.loads(header["__metadata__"]["mmkv"])
    except Exception as exc:  # safetensors and json raise their own errors for malformed input
        raise CorruptEntryError(f"patch record truncated or unparseable: {exc}") from exc
    expected = {"format": _FORMAT, "kind": "patch", "fingerprint": fingerprint, "digest": digest}
    if any(meta.get(k) != v for k, v in expected.items()) or set(tensors) != set(_NAMES):
        raise CorruptEntryError("patch record of another version, kind, model or digest")
    if payload_checksum(tensors) != meta.get("checksum"):
        raise CorruptEntryError("checksum mismatch: the patch payload differs from what was written")
    try:
        return SegmentPatch(
            digest, *(tensors[name] for name in _NAMES), num_contexts=int(meta["num_contexts"])
        )
    except (ValueError, KeyError) as exc:
        raise CorruptEntryError(f"patch record does not form a patch: {exc}") from exc


def _check(patch: SegmentPatch, digest: str) -> SegmentPatch:
    if not isinstance(patch, SegmentPatch) or patch.digest != digest:
        raise ValueError(
            f"a PatchStore holds a SegmentPatch under its segment's digest, got {type(patch).__name__}"
        )
    return patch


_PATCH_CODEC: StoreCodec[SegmentPatch] = StoreCodec(
    kind="patch",
    encode=lambda patch, fingerprint, digest: encode_patch(patch, fingerprint),
    decode=lambda data, fingerprint, digest, handle: decode_patch(data, fingerprint, digest),
    nbytes=lambda patch: patch.nbytes,
    check=_check,
    view=lambda patch: patch,  # immutable
)


class PatchStore(TieredStore[SegmentPatch]):
    """Segment patches per model and segment digest: the same tiers and methods as ``KVStore`` (memory, disk
    directories, Redis URLs; ``get``, ``lookup``, ``put``, ``contains``), its own record kind, so one directory
    may hold both."""

    codec = _PATCH_CODEC
