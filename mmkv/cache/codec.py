"""The on-disk record format of the stores: named tensors plus JSON metadata in one safetensors blob, no pickle.

A record is a safetensors file held in memory as ``bytes``: the tensors (moved to the CPU, contiguous, dtype
kept, so bfloat16 round-trips byte for byte) and, in the safetensors ``__metadata__`` field under the key
``"mmkv"``, one JSON object with the format version, the record kind (``"segment"`` or ``"features"``), the
model fingerprint, the content digest, a SHA-256 checksum of the tensor payload (each tensor's name, dtype,
shape and raw bytes, in sorted name order) and the record's own fields. Decoding trusts nothing: every check
that fails (unparseable or truncated bytes, unknown version, wrong kind, fingerprint or digest, checksum
mismatch, missing tensors, inconsistent shapes) raises ``CorruptEntryError``, and the caller recomputes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ..kv.segment import KVSegment
from ..kv.vision import ImageFeatures
from ..mrope import RotaryLayout

__all__ = [
    "FORMAT_VERSION",
    "CorruptEntryError",
    "decode_features",
    "decode_segment",
    "encode_features",
    "encode_segment",
    "payload_checksum",
]

FORMAT_VERSION = 1  # bump when the record layout changes; decode rejects every other version
_META_KEY = "mmkv"  # the safetensors metadata key holding the JSON header
_SEGMENT_TENSORS = ("keys", "values", "token_ids", "position_ids")


class CorruptEntryError(ValueError):
    """A stored record failed a check on decode (truncated, unparseable, checksum, fingerprint, digest, kind).

    Raised by the ``decode_*`` functions; the stores catch it, count it, drop the entry and report a miss.
    """


def payload_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex over each tensor's name, dtype, shape and raw bytes, in sorted name order.

    ``tensors`` must be on the CPU. Does not change them.
    """
    h = hashlib.sha256(b"mmkv-payload-v1\0")
    for name in sorted(tensors):
        tensor = tensors[name]
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # (nbytes,) raw bytes
    return h.hexdigest()


def _to_cpu_owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous and owning its whole storage (safetensors refuses shared storage)."""
    out = tensor.detach().to("cpu").contiguous()
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone()  # a view into a larger buffer (a split or a slice): copy just this part
    return out


def _encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """safetensors bytes of ``tensors`` with ``header`` (plus version and checksum) as JSON metadata."""
    cpu = {name: _to_cpu_owned(t) for name, t in tensors.items()}
    meta = {"format": FORMAT_VERSION, **header, "checksum": payload_checksum(cpu)}
    return _st_save(cpu, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})


def _read_header(data: bytes) -> dict[str, Any]:
    """The JSON header of a record, parsed from the safetensors preamble without loading any tensor."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < 8:
        raise CorruptEntryError("record truncated or unparseable: shorter than the safetensors preamble")
    (size,) = struct.unpack("<Q", bytes(data[:8]))
    if size > len(data) - 8:
        raise CorruptEntryError("record truncated or unparseable: header runs past the end of the data")
    try:
        st_header = json.loads(bytes(data[8 : 8 + size]))
        meta = json.loads(st_header["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntryError(f"record truncated or unparseable: bad header ({exc})") from exc
    if not isinstance(meta, dict):
        raise CorruptEntryError("record truncated or unparseable: metadata is not a JSON object")
    return meta


def _decode(
    data: bytes, kind: str, expected_fingerprint: str, expected_digest: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (CPU) and header of a record, after every check. Raises ``CorruptEntryError``."""
    meta = _read_header(data)
    if meta.get("format") != FORMAT_VERSION:
        raise CorruptEntryError(
            f"unknown record format version {meta.get('format')!r} (know {FORMAT_VERSION})"
        )
    if meta.get("kind") != kind:
        raise CorruptEntryError(f"kind mismatch: record holds {meta.get('kind')!r}, expected {kind!r}")
    if meta.get("fingerprint") != expected_fingerprint:
        raise CorruptEntryError(
            f"fingerprint mismatch: record was written by model {str(meta.get('fingerprint'))[:16]}..., "
            f"expected {expected_fingerprint[:16]}..."
        )
    if meta.get("digest") != expected_digest:
        raise CorruptEntryError(
            f"digest mismatch: record holds {str(meta.get('digest'))[:16]}..., requested {expected_digest[:16]}..."
        )
    try:
        tensors = _st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own SafetensorError for every malformed input
        raise CorruptEntryError(f"record truncated or unparseable: {exc}") from exc
    if payload_checksum(tensors) != meta.get("checksum"):
        raise CorruptEntryError("checksum mismatch: the tensor payload differs from what was written")
    return tensors, meta


def _expect_names(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
    """Raise ``CorruptEntryError`` unless ``tensors`` holds exactly ``names``."""
    if set(tensors) != set(names):
        raise CorruptEntryError(
            f"unexpected tensors: record holds {sorted(tensors)}, expected {sorted(names)}"
        )


def encode_segment(segment: KVSegment, fingerprint: str) -> bytes:
    """Record bytes of ``segment`` (K, V, token ids, positions, kind, digest) as computed by ``fingerprint``.

    The rotary layout is not stored (``decode_segment`` takes it from the handle). Does not change ``segment``.
    """
    tensors = {name: getattr(segment, name) for name in _SEGMENT_TENSORS}
    header = {
        "kind": "segment",
        "fingerprint": fingerprint,
        "digest": segment.digest,
        "segment_kind": segment.kind,
    }
    return _encode(tensors, header)


def decode_segment(
    data: bytes,
    expected_fingerprint: str,
    expected_digest: str,
    rotary: RotaryLayout,
    device: torch.device | str,
) -> KVSegment:
    """The ``KVSegment`` in ``data``: K and V on ``device`` (stored dtype kept), ids and positions on the CPU.

    Raises ``CorruptEntryError`` if ``data`` is truncated or unparseable, of an unknown version or another kind,
    written under another fingerprint or digest, fails its checksum, or does not form a valid segment.
    """
    tensors, meta = _decode(data, "segment", expected_fingerprint, expected_digest)
    _expect_names(tensors, _SEGMENT_TENSORS)
    if meta.get("segment_kind") not in ("image", "text"):
        raise CorruptEntryError(f"unexpected segment kind {meta.get('segment_kind')!r}")
    try:
        return KVSegment(
            keys=tensors["keys"].to(device),  # (layers, 1, kv_heads, L, D)
            values=tensors["values"].to(device),  # (layers, 1, kv_heads, L, D)
            token_ids=tensors["token_ids"],  # (L,) long
            position_ids=tensors["position_ids"],  # (3, L) long
            kind=meta["segment_kind"],
            digest=meta["digest"],
            rotary=rotary,
        )
    except ValueError as exc:
        raise CorruptEntryError(f"record does not form a valid segment: {exc}") from exc


def encode_features(features: Sequence[ImageFeatures], fingerprint: str, digest: str) -> bytes:
    """Record bytes of the vision-tower outputs ``features`` (embeds and DeepStack tensors of each image).

    Does not change ``features``.
    """
    tensors: dict[str, torch.Tensor] = {}
    for i, feat in enumerate(features):
        tensors[f"{i}.embeds"] = feat.embeds  # (pads, lm_hidden)
        for k, layer in enumerate(feat.deepstack):
            tensors[f"{i}.deepstack.{k}"] = layer  # (pads, lm_hidden)
    header = {
        "kind": "features",
        "fingerprint": fingerprint,
        "digest": digest,
        "num_deepstack": [len(f.deepstack) for f in features],
    }
    return _encode(tensors, header)


def decode_features(
    data: bytes, expected_fingerprint: str, expected_digest: str, device: torch.device | str
) -> list[ImageFeatures]:
    """The ``ImageFeatures`` in ``data``, in order, with every tensor on ``device`` (stored dtype kept).

    Raises ``CorruptEntryError`` on the same failures as ``decode_segment``.
    """
    tensors, meta = _decode(data, "features", expected_fingerprint, expected_digest)
    counts = meta.get("num_deepstack")
    if not isinstance(counts, list) or not all(isinstance(c, int) and c >= 0 for c in counts):
        raise CorruptEntryError(f"bad num_deepstack field {counts!r}")
    names = [f"{i}.embeds" for i in range(len(counts))]
    names += [f"{i}.deepstack.{k}" for i, n in enumerate(counts) for k in range(n)]
    _expect_names(tensors, names)
    return [
        ImageFeatures(
            embeds=tensors[f"{i}.embeds"].to(device),  # (pads, lm_hidden)
            deepstack=tuple(tensors[f"{i}.deepstack.{k}"].to(device) for k in range(n)),
        )
        for i, n in enumerate(counts)
    ]
