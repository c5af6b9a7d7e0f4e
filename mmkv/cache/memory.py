"""``MemoryTier``: the in-process tier of a store, an LRU map bounded by the bytes of the values it holds.

Values are live objects (tensors stay where they are, on the model's device), kept in an ``OrderedDict`` ordered
by last use; the least recently used are evicted until the byte total fits the bound. Thread-safe (one lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["MemoryTier"]

V = TypeVar("V")


class MemoryTier(Generic[V]):
    """An LRU map ``key -> value`` bounded by the sum of the byte sizes the caller declares for the values.

    Thread-safe (one lock). Values are held as given (never copied). Counters: ``hits``, ``misses``,
    ``evictions``; ``bytes`` is the current total.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes  # bound on the sum of the entries' declared sizes
        # key -> (value, nbytes); LRU first
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0  # sum of the declared sizes of the entries held
        self.hits = 0  # get() calls that found their key
        self.misses = 0  # get() calls that did not
        self.evictions = 0  # entries dropped to make room

    def get(self, key: Hashable) -> V | None:
        """The value under ``key`` (marking it most recently used), or ``None``. Counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> bool:
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

    def delete(self, key: Hashable) -> bool:
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

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is held. Changes no counter and not the LRU order."""
        return key in self._entries

    def __len__(self) -> int:
        """Entries held."""
        return len(self._entries)
