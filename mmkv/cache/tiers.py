"""The two storage tiers under the stores: a byte-bounded in-process LRU, and a persistent diskcache of bytes.

``MemoryTier`` keeps live objects (tensors stay where they are, on the model's device) in an ``OrderedDict``
ordered by last use and evicts the least recently used until the byte total fits its bound. ``DiskTier`` wraps a
``diskcache.Cache`` (SQLite index plus files for values over 32 KiB; safe to share between processes) that stores
raw ``bytes`` only: a bytes-only ``Disk`` refuses to write anything else and refuses to read back an entry stored
in any other mode, so nothing is ever unpickled, even from a directory someone else wrote into. A failed disk
write (disk full, read-only directory) never raises: it is counted, logged, and the memory tier keeps the only
copy.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW

from .codec import CorruptEntryError

__all__ = ["DiskTier", "MemoryTier"]

logger = logging.getLogger(__name__)

V = TypeVar("V")
T = TypeVar("T")


class MemoryTier(Generic[V]):
    """An LRU map ``key -> value`` bounded by the sum of the byte sizes the caller declares for the values.

    Thread-safe (one lock). Values are held as given (never copied). Counters: ``hits``, ``misses``,
    ``evictions``; ``bytes`` is the current total.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes  # bound on the sum of the entries' declared sizes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()  # key -> (value, nbytes); LRU first
        self._lock = threading.Lock()
        self.bytes = 0  # sum of the declared sizes of the entries held
        self.hits = 0  # get() calls that found their key
        self.misses = 0  # get() calls that did not
        self.evictions = 0  # entries dropped to make room

    def get(self, key: str) -> V | None:
        """The value under ``key`` (marking it most recently used), or ``None``. Counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: str, value: V, nbytes: int) -> bool:
        """Store ``value`` (declared ``nbytes``) under ``key``, replacing any previous value, then evict least
        recently used entries until the total is within ``max_bytes``.

        A value larger than ``max_bytes`` is not stored (and any previous value under ``key`` is dropped).
        Returns whether the value is now held.
        """
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if nbytes > self.max_bytes:
                return False
            self._entries[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
                self.evictions += 1
            return True

    def delete(self, key: str) -> bool:
        """Drop ``key`` if held (not counted as an eviction). Returns whether it was held."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is None:
                return False
            self.bytes -= old[1]
            return True

    def clear(self) -> None:
        """Drop every entry. Counters are kept."""
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is held. Changes no counter and not the LRU order."""
        return key in self._entries

    def __len__(self) -> int:
        """Entries held."""
        return len(self._entries)


class _BytesOnlyDisk(diskcache.Disk):
    """A ``diskcache.Disk`` that stores ``bytes`` only and never unpickles.

    Writing anything but ``bytes`` raises ``TypeError``; reading an entry stored in any other mode (pickle,
    text, a number) raises ``CorruptEntryError``. Keys are ``str`` (diskcache stores them as SQLite text).
    """

    def store(self, value, read, key=diskcache.UNKNOWN):
        if type(value) is not bytes:
            raise TypeError(f"DiskTier stores bytes only, got {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode, filename, value, read):
        if mode not in (MODE_RAW, MODE_BINARY) or read:
            raise CorruptEntryError(
                f"disk entry is not raw bytes (diskcache mode {mode}); refusing to decode it"
            )
        out = super().fetch(mode, filename, value, read)
        if type(out) is not bytes:
            raise CorruptEntryError(f"disk entry is not raw bytes ({type(out).__name__})")
        return out


class DiskTier:
    """A persistent map ``str -> bytes`` in a diskcache directory, bounded (approximately) by ``max_bytes``.

    diskcache evicts least recently used entries on writes once the directory's volume (SQLite file plus value
    files) exceeds ``max_bytes``. Several ``DiskTier`` objects, in one process or many, may share a directory.
    The counters (``hits``, ``misses``, ``corrupt``, ``write_errors``) are this object's own; entries and volume
    are read from the shared directory.
    """

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path)  # the diskcache directory (created if missing)
        self.max_bytes = max_bytes  # diskcache size_limit
        self._cache = diskcache.Cache(
            str(self.path),
            size_limit=max_bytes,
            eviction_policy="least-recently-used",
            disk=_BytesOnlyDisk,
        )
        self.hits = 0  # get() calls that returned a value
        self.misses = 0  # get() calls that found nothing (a corrupt entry counts in corrupt instead)
        self.corrupt = 0  # entries that failed to decode and were deleted
        self.write_errors = 0  # put() calls that failed with an OS or SQLite error

    def get(self, key: str, decode: Callable[[bytes], T] | None = None) -> T | bytes | None:
        """The bytes under ``key`` (or ``decode(bytes)`` if ``decode`` is given), or ``None``.

        If the entry is not raw bytes or ``decode`` raises ``CorruptEntryError``, the entry is deleted, counted in
        ``corrupt`` and ``None`` is returned (the caller recomputes); otherwise counts a hit or a miss. Other
        exceptions of ``decode`` propagate. Marks the entry most recently used.
        """
        try:
            data = self._cache.get(key, default=None, retry=True)
            if data is None:
                self.misses += 1
                return None
            value = data if decode is None else decode(data)
        except CorruptEntryError as exc:
            self.corrupt += 1
            logger.warning("mmkv cache: dropping corrupt entry %s in %s: %s", key, self.path, exc)
            self.delete(key)
            return None
        self.hits += 1
        return value

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key``, replacing any previous value. Never raises on a failed write.

        A value larger than ``max_bytes`` is not stored. A write that fails with ``OSError`` (``ENOSPC``, a
        read-only directory) or a SQLite error ("database or disk is full") is counted in ``write_errors`` and
        logged as a warning. Returns whether the value was written.
        """
        if type(data) is not bytes:
            raise TypeError(f"DiskTier stores bytes only, got {type(data).__name__}")
        if len(data) > self.max_bytes:
            return False
        try:
            self._cache.set(key, data, retry=True)
        except (OSError, sqlite3.Error) as exc:
            self.write_errors += 1
            logger.warning(
                "mmkv cache: could not write %s to %s (kept in memory only): %s", key, self.path, exc
            )
            return False
        return True

    def delete(self, key: str) -> bool:
        """Remove ``key`` if present. Returns whether it was."""
        return bool(self._cache.delete(key, retry=True))

    def clear(self) -> None:
        """Remove every entry in the directory (for every process sharing it). Counters are kept."""
        self._cache.clear(retry=True)

    def close(self) -> None:
        """Close the SQLite connection (reopened on next use)."""
        self._cache.close()

    def volume(self) -> int:
        """Bytes the directory occupies: SQLite pages plus value files."""
        return int(self._cache.volume())

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is present (not validated). Changes no counter and not the LRU order."""
        return key in self._cache

    def __len__(self) -> int:
        """Entries in the directory."""
        return len(self._cache)
