"""Content-addressed caches of image work: the KV store, the vision-encoder store, their record codec and keys.

``KVStore`` (KV segments of images and precompiled text) and ``EncoderStore``
(vision-tower outputs) each keep a byte-bounded in-memory LRU over an optional persistent diskcache directory
shared safely between processes; entries are keyed by model fingerprint and content digest (``image_digest``, ``text_digest``) and stored as checksummed
safetensors records, never pickled. A record that fails a check raises ``CorruptEntryError`` inside the store,
which drops it and reports a miss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes

if TYPE_CHECKING:  # imported on first use (torch comes with them), so ``cache.directory`` stays light
    from .codec import CorruptEntryError
    from .digest import ImageDigest, TextDigest, image_digest, text_digest
    from .store import EncoderStore, KVStore, StoreStats, TierStats

_LAZY_NAMES = {  # public name -> the module that defines it
    "CorruptEntryError": "codec",
    **dict.fromkeys(["ImageDigest", "TextDigest", "image_digest", "text_digest"], "digest"),
    **dict.fromkeys(["EncoderStore", "KVStore", "StoreStats", "TierStats"], "store"),
}

_SUBMODULES = frozenset(["codec", "digest", "directory", "disk", "memory", "redis", "store", "sweep"])


__getattr__ = lazy_attributes(__name__, globals(), _LAZY_NAMES, _SUBMODULES)


__all__ = [
    "CorruptEntryError",
    "EncoderStore",
    "ImageDigest",
    "KVStore",
    "StoreStats",
    "TextDigest",
    "TierStats",
    "image_digest",
    "text_digest",
]
