"""Freed heap memory given back to the operating system between requests.

A server decodes images and builds tensors on many threads; glibc's allocator keeps what they free in per-thread
arenas, so the resident size drifts up with fragmentation long after every cache is full (measured by
``bench/soak.py``). ``HeapTrim`` calls glibc's ``malloc_trim(0)`` (which also returns free pages inside the heap
with ``madvise``) every ``every`` requests. Where there is no glibc (macOS, musl) it does nothing.

    >>> trim = HeapTrim(every=2, trim=lambda: True)
    >>> [trim.tick() for _ in range(4)]
    [False, True, False, True]
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

__all__ = ["HeapTrim", "malloc_trim"]


def malloc_trim() -> bool:
    """Ask glibc to return free heap memory; True if it released any, False if none or no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(function(0))


class HeapTrim:
    """Counts requests and trims the heap every ``every`` of them (not thread-safe: one worker owns it)."""

    def __init__(self, every: int = 64, trim: Callable[[], bool] = malloc_trim) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self._trim, self._count = every, trim, 0
        self.trims = 0  # times trimmed

    def tick(self) -> bool:
        """One request done; trims (and returns True) on every ``every``-th."""
        self._count += 1
        if self._count % self.every:
            return False
        self._trim()
        self.trims += 1
        return True
