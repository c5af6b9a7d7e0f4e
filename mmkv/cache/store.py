"""The stores: a byte-bounded memory tier over optional lower tiers (disk directories, Redis), keyed by model and
digest.

``KVStore`` keeps language-model KV (``KVSegment``: images, precompiled text), ``EncoderStore`` the vision-tower
outputs (``list[ImageFeatures]``); both are one generic ``TieredStore`` with a different ``StoreCodec``. A
lookup tries the memory tier (live objects on the model's device), then each lower tier in order (records in
the ``mmkv.cache.codec`` format, decoded on the handle's device and promoted to memory). Every key is
``"{model fingerprint}/{kind}/{digest}"``, so one model never even looks at another's entries, and each decoded
record's own fingerprint and digest are checked again. A record that fails any check is counted as corrupt,
deleted, and reported as absent: the caller recomputes. Several processes may share one directory or one Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, Literal, TypeVar

from ..kv.segment import KVSegment
from ..kv.vision import ImageFeatures
from ..model.handle import ModelHandle
from .codec import decode_features, decode_segment, encode_features, encode_segment
from .disk import DiskTier
from .memory import MemoryTier
from .redis import RedisTier

__all__ = [
    "EncoderStore",
    "KVStore",
    "StoreCodec",
    "StoreStats",
    "StoreTier",
    "TierStats",
    "TieredStore",
]

V = TypeVar("V")
StoreTier = Literal["memory", "disk", "redis"]  # the tier that answered a lookup


@dataclass(frozen=True)
class TierStats:
    """Counters and occupancy of one tier (counters cover this store object's lifetime, ``clear`` included)."""

    hits: int  # lookups this tier answered
    misses: int  # lookups this tier did not (a corrupt entry counts in ``corrupt`` instead)
    evictions: int  # entries dropped for room; memory tier only (diskcache culls without telling: 0 on disk)
    bytes: int  # memory: declared bytes held; disk: the directory's volume (SQLite pages + value files)
    entries: int  # entries held (disk: in the whole directory, whichever process wrote them)
    corrupt: int  # disk entries that failed decoding and were deleted (always 0 in memory)
    write_errors: int  # disk writes that failed and were skipped (always 0 in memory)
    read_errors: int = 0  # disk reads that failed with a storage fault and were treated as misses


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's tiers."""

    memory: TierStats  # the in-process LRU tier
    disk: TierStats | None  # the (first) disk tier; None when the store has none
    redis: TierStats | None = None  # the (first) Redis tier; None when the store has none
    tiers: dict | None = None  # every tier's stats by name ("memory", "disk", "redis"), in lookup order


@dataclass(frozen=True)
class StoreCodec(Generic[V]):
    """What a ``TieredStore`` needs to know about its values."""

    kind: str  # record kind: the middle part of every key, and the codec's "kind" field
    encode: Callable[[V, str, str], bytes]  # (value, fingerprint, digest) -> record bytes
    decode: Callable[[bytes, str, str, ModelHandle], V]  # (data, fingerprint, digest, handle) -> value
    nbytes: Callable[[V], int]  # bytes the value holds, for the memory bound
    check: Callable[[V, str], V]  # (value, digest) -> the value to hold; raises ValueError if unfit
    view: Callable[[V], V]  # what get() and lookup() hand out for a held value (copy of a mutable container)


class TieredStore(Generic[V]):
    """A memory tier of live values over an optional disk tier of encoded records, for one value type.

    Subclasses set ``codec``. Not copyable between processes; several stores (in one process or many) may
    share one ``path``.
    """

    codec: ClassVar[StoreCodec]

    def __init__(
        self,
        path: str | Path | Sequence[str | Path] | None = None,
        max_bytes: int = 2 << 30,
        disk_max_bytes: int | None = None,
        *,
        redis_ttl_s: float | None = None,
        redis_timeout_s: float = 0.5,
    ):
        """A store holding up to ``max_bytes`` of values in memory over the tiers ``path`` names, in order: a
        directory is a disk tier (up to about ``disk_max_bytes``; default the smaller of 16 GiB and 90% of the
        disk's free space), a ``redis://`` / ``rediss://`` URL a Redis tier (entries expire after
        ``redis_ttl_s`` when set; every Redis call bounded by ``redis_timeout_s``). Raises
        ``StoreUnavailableError`` when a directory cannot be opened, or for a Redis URL without the optional
        ``redis`` package (the message says ``pip install redis``); once open, storage faults never raise
        (they are counted), and an unreachable Redis is a counted miss."""
        entries = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
        self._memory: MemoryTier[V] = MemoryTier(max_bytes)
        self._tiers: list[tuple[str, DiskTier | RedisTier]] = []  # below memory, in lookup order
        for entry in entries:
            if isinstance(entry, str) and entry.startswith(("redis://", "rediss://", "unix://")):
                self._tiers.append(("redis", RedisTier(entry, ttl_s=redis_ttl_s, timeout_s=redis_timeout_s)))
            else:
                self._tiers.append(("disk", DiskTier(Path(entry).expanduser(), disk_max_bytes)))
        disks = [t for name, t in self._tiers if name == "disk"]
        self.path = disks[0].path if disks else None  # the (first) disk tier's directory, if any

    @property
    def _disk(self) -> DiskTier | None:
        return next((t for name, t in self._tiers if name == "disk"), None)

    def _key(self, digest: str, handle: ModelHandle) -> str:
        """The key of ``digest`` under ``handle``'s model, in every tier."""
        return f"{handle.fingerprint}/{self.codec.kind}/{digest}"

    def get(self, digest: str, handle: ModelHandle) -> V | None:
        """The value stored for ``digest`` under ``handle``'s model, or ``None`` (the caller computes it).

        Memory first; else each lower tier in order, its record decoded with the tensors on ``handle.device``
        and promoted to memory. A record that fails decoding is counted as corrupt, deleted from that tier, and
        the next tier is asked. Updates the hit, miss and LRU bookkeeping of the tiers it reads.
        """
        return self.lookup(digest, handle)[0]

    def lookup(self, digest: str, handle: ModelHandle) -> tuple[V | None, StoreTier | None]:
        """``get``, also saying which tier answered: ``(value, "memory" | "disk" | "redis")``, or
        ``(None, None)``."""
        key = self._key(digest, handle)
        value = self._memory.get(key)
        if value is not None:
            return self.codec.view(value), "memory"
        fingerprint = str(handle.fingerprint)
        for name, tier in self._tiers:
            value = tier.get(key, lambda data: self.codec.decode(data, fingerprint, digest, handle))
            if value is not None:
                self._memory.put(key, value, self.codec.nbytes(value))
                return self.codec.view(value), name
        return None, None

    def put(self, digest: str, value: V, handle: ModelHandle) -> None:
        """Store ``value`` for ``digest`` under ``handle``'s model, in memory (held as given, not copied) and in
        every lower tier. Raises ``ValueError`` if ``value`` does not fit ``digest``. Never raises on a failed
        tier write (counted in ``write_errors``); a value over a tier's bound is not stored in that tier. Records
        are always (re)written, which also repairs one whose value file or chunks went missing.
        """
        value = self.codec.check(value, digest)
        key = self._key(digest, handle)
        self._memory.put(key, value, self.codec.nbytes(value))
        if self._tiers:
            record = self.codec.encode(value, str(handle.fingerprint), digest)
            for _, tier in self._tiers:
                tier.put(key, record)

    def contains(self, digest: str, handle: ModelHandle) -> bool:
        """Whether a tier holds ``digest`` under ``handle``'s model (records are not decoded, so one may still
        turn out corrupt). Changes no counter and no LRU order."""
        key = self._key(digest, handle)
        return key in self._memory or any(key in tier for _, tier in self._tiers)

    def stats(self) -> StoreStats:
        """A snapshot of every tier's counters and occupancy."""
        mem = self._memory
        memory = TierStats(
            mem.hits, mem.misses, mem.evictions, mem.bytes, len(mem), corrupt=0, write_errors=0
        )
        tiers = {"memory": memory}
        for name, t in self._tiers:
            stats = TierStats(t.hits, t.misses, 0, t.volume(), len(t), corrupt=t.corrupt,
                              write_errors=t.write_errors, read_errors=t.read_errors)  # fmt: skip
            tiers.setdefault(name, stats)
        return StoreStats(memory=memory, disk=tiers.get("disk"), redis=tiers.get("redis"), tiers=tiers)

    def clear(self) -> None:
        """Empty every tier (a disk directory or Redis database for every store sharing it, all models).
        Counters are kept."""
        self._memory.clear()
        for _, tier in self._tiers:
            tier.clear()

    def close(self) -> None:
        """Close the lower tiers' connections (they reopen on next use). The memory tier is kept."""
        for _, tier in self._tiers:
            tier.close()


def _check_segment(segment: KVSegment, digest: str) -> KVSegment:
    if not isinstance(segment, KVSegment):
        raise TypeError(f"KVStore holds KVSegment values, got {type(segment).__name__}")
    if segment.digest != digest:
        raise ValueError(
            f"segment digest {segment.digest!r} differs from the key {digest!r}; "
            "build it with prefill_span(..., digest=digest) or dataclasses.replace(segment, digest=digest)"
        )
    return segment


def _check_features(features: Sequence[ImageFeatures], digest: str) -> list[ImageFeatures]:
    if isinstance(features, ImageFeatures) or not all(isinstance(f, ImageFeatures) for f in features):
        raise TypeError("EncoderStore holds lists of ImageFeatures (one per image)")
    if not features:
        raise ValueError("EncoderStore cannot hold an empty feature list")
    return list(features)


_SEGMENT_CODEC: StoreCodec[KVSegment] = StoreCodec(
    kind="segment",
    encode=lambda segment, fingerprint, digest: encode_segment(segment, fingerprint),
    decode=lambda data, fingerprint, digest, handle: decode_segment(
        data, fingerprint, digest, handle.rotary, handle.device
    ),
    nbytes=lambda segment: segment.nbytes,
    check=_check_segment,
    view=lambda segment: segment,  # immutable
)

_FEATURES_CODEC: StoreCodec[list[ImageFeatures]] = StoreCodec(
    kind="features",
    encode=encode_features,
    decode=lambda data, fingerprint, digest, handle: decode_features(
        data, fingerprint, digest, handle.device
    ),
    nbytes=lambda features: sum(f.nbytes for f in features),
    check=_check_features,
    view=list,  # a fresh list each time, so callers cannot change what the store holds
)


class KVStore(TieredStore[KVSegment]):
    """Language-model KV segments (``KVSegment``, digest equal to the key) per model and content digest: images
    (``image_digest``) and precompiled text (``text_digest``).

    ``get(digest, handle) -> KVSegment | None``, ``lookup`` (value and tier), ``put(digest, segment, handle)``,
    ``contains``, ``stats``, ``clear``: see ``TieredStore``. Segments come back at the positions they were stored at (``moved_to`` them).
    """

    codec = _SEGMENT_CODEC


class EncoderStore(TieredStore[list[ImageFeatures]]):
    """Vision-tower outputs (``list[ImageFeatures]``, usually one) per model and image digest.

    Same methods as ``KVStore``; ``get`` returns a fresh list of the held (immutable) features.
    """

    codec = _FEATURES_CODEC
