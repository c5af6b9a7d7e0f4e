"""Content-addressed caches of image work: the KV store, the vision-encoder store, their record codec and keys.

``KVStore`` (KV segments of images and precompiled text) and ``EncoderStore``
(vision-tower outputs) each keep a byte-bounded in-memory LRU over an optional persistent diskcache directory
shared safely between processes; entries are keyed by model fingerprint and content digest (``image_digest``, ``text_digest``) and stored as checksummed
safetensors records, never pickled. A record that fails a check raises ``CorruptEntryError`` inside the store,
which drops it and reports a miss.
"""

from __future__ import annotations

from .codec import CorruptEntryError
from .digest import ImageDigest, TextDigest, image_digest, text_digest
from .store import EncoderStore, KVStore, StoreStats, TierStats

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
