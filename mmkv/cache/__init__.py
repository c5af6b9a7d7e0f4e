"""Content-addressed caches of image work: the KV store, the vision-encoder store, their record codec and keys.

``KVStore`` (KV segments of images and precompiled text) and ``EncoderStore``
(vision-tower outputs) each keep a byte-bounded in-memory LRU over an optional persistent diskcache directory
shared safely between processes; entries are keyed by model fingerprint and content digest (``image_digest``, ``text_digest``) and stored as checksummed
safetensors records, never pickled. A record that fails a check raises ``CorruptEntryError`` inside the store,
which drops it and reports a miss.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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


def __getattr__(name: str):
    """A public name, imported from its module on first use (then kept as a package attribute)."""
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


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
