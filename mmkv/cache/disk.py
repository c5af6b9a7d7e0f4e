"""``DiskTier``: the persistent tier of a store, a diskcache directory of raw bytes shared between processes.

diskcache keeps an SQLite index (``cache.db``) and, for values over 32 KiB, one value file per entry under
``xx/yy/<28 hex>.val``. mmkv trusts none of it:

- **bytes only**: a bytes-only ``Disk`` refuses to write anything else and to read back an entry stored in any
  other mode, so nothing is ever unpickled, even from a directory someone else wrote into;
- **paths confined**: every value file the index names must have diskcache's own name shape
  (``xx/yy/<28 hex>.val``), and is opened, written and unlinked component by component below the directory's
  descriptor without following a link (``mmkv.confined``): a row naming anything else, or a folder or file on
  the way that is a symbolic link (planted, or swapped in between a check and the open), is a corrupt entry,
  dropped from the index only; no file outside the directory is ever read, written or deleted; an index file
  (``cache.db`` and its ``-wal`` / ``-shm``) that is a link is refused at open (SQLite opens files by name);
- **faults contained**: opening either works or raises ``StoreUnavailableError`` saying what is wrong (a file
  where the directory should be, no permission, a corrupt index, a full disk). Once open, no storage fault
  raises: a failed read is a miss counted in ``read_errors``, a failed write is counted in ``write_errors``
  (the memory tier keeps the only copy); a directory deleted or replaced under it is detected at the next
  write and the tier stops writing (``lost``);
- **bounded**: the size bound defaults to the smaller of 16 GiB and 90% of what the disk can give it;
- **swept**: value files no index row names (a writer killed mid-write) older than ``ORPHAN_AGE_S`` are removed
  when a tier opens the directory, without following any link (``mmkv.cache.sweep``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW

from ..confined import (
    ConfinementError,
    create_file_beneath,
    open_file_beneath,
    open_root,
    unlink_beneath,
)
from ..errors import StoreUnavailableError
from .codec import CorruptEntryError
from .directory import open_error as _open_error
from .sweep import sweep_orphans

__all__ = ["DEFAULT_DISK_MAX_BYTES", "DiskTier"]

logger = logging.getLogger("mmkv.cache")

T = TypeVar("T")
DEFAULT_DISK_MAX_BYTES = 16 << 30  # upper end of the default bound (also capped by the free space)
_VALUE_NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")  # diskcache's own file names
_FAULTS = (OSError, sqlite3.Error, diskcache.Timeout)  # what storage can throw at us once open


class _BytesOnlyDisk(diskcache.Disk):
    """A ``diskcache.Disk`` that stores ``bytes`` only, never unpickles, and never touches a path outside its
    directory: value files are created, read and unlinked through ``mmkv.confined`` (no link followed below the
    directory). Writing anything but ``bytes`` raises ``TypeError``; reading an entry stored in another mode or
    naming anything but one of its own value files raises ``CorruptEntryError``; removing such a name does
    nothing."""

    def inside(self, filename: str | None) -> bool:
        """Whether ``filename`` (as an index row holds it) has the shape of a value file of this directory."""
        return isinstance(filename, str) and _VALUE_NAME.fullmatch(filename) is not None

    def store(self, value, read, key=diskcache.UNKNOWN):
        if type(value) is not bytes:
            raise TypeError(f"DiskTier stores bytes only, got {type(value).__name__}")
        if len(value) < self.min_file_size:
            return super().store(value, read, key=key)
        for attempt in range(10):  # another process may prune an emptied folder between mkdir and open
            filename, _ = self.filename(key, value)
            root = open_root(self._directory)
            try:
                create_file_beneath(root, filename.split("/"), value)
                return len(value), MODE_BINARY, filename, None
            except (FileNotFoundError, FileExistsError):
                if attempt == 9:
                    raise
            finally:
                os.close(root)

    def fetch(self, mode, filename, value, read):
        if mode not in (MODE_RAW, MODE_BINARY) or read:
            raise CorruptEntryError(
                f"disk entry is not raw bytes (diskcache mode {mode}); refusing to decode it"
            )
        if filename is None:
            out = super().fetch(mode, filename, value, read)
        elif not self.inside(filename):
            raise CorruptEntryError(f"disk entry names a file outside the store ({filename!r}); not read")
        else:
            out = self._read(filename)
        if type(out) is not bytes:
            raise CorruptEntryError(f"disk entry is not raw bytes ({type(out).__name__})")
        return out

    def _read(self, filename: str) -> bytes:
        """The bytes of the value file ``filename``, opened below the directory without following a link.
        A missing file raises ``OSError`` (diskcache's miss); a link or a non-file, ``CorruptEntryError``."""
        root = open_root(self._directory)
        try:
            fd = open_file_beneath(root, filename.split("/"))
        except ConfinementError as exc:
            raise CorruptEntryError(
                f"disk entry {filename!r} is not a file of the store ({exc}); not read"
            ) from None
        finally:
            os.close(root)
        with os.fdopen(fd, "rb") as reader:
            return reader.read()

    def remove(self, file_path):
        if not self.inside(file_path):
            logger.warning(
                "mmkv cache: not removing %r: it is not a value file of %s", file_path, self._directory
            )
            return
        try:
            root = open_root(self._directory)
            try:
                unlink_beneath(root, file_path.split("/"), prune=True)
            finally:
                os.close(root)
        except ConfinementError as exc:
            logger.warning("mmkv cache: not removing %r from %s: %s", file_path, self._directory, exc)
        except OSError:
            pass  # gone already, or removed by another process first (diskcache suppresses these too)


class DiskTier:
    """A persistent map ``str -> bytes`` in a diskcache directory, bounded (approximately) by ``max_bytes``.

    diskcache evicts least recently used entries on writes once the directory's volume (SQLite file plus value
    files) exceeds ``max_bytes``. Several ``DiskTier`` objects, in one process or many, may share a directory.
    The counters are this object's own; entries and volume are read from the shared directory.
    """

    def __init__(self, path: str | Path, max_bytes: int | None = None, timeout_s: float = 2.0) -> None:
        """Open (creating if needed) the directory ``path``. ``max_bytes=None``: the smaller of
        ``DEFAULT_DISK_MAX_BYTES`` and 90% of the free space plus what the directory holds already.
        ``timeout_s`` bounds each wait for another process's SQLite lock. Raises ``StoreUnavailableError``."""
        self.path = Path(path)  # the diskcache directory
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for name in (
                diskcache.core.DBNAME,
                diskcache.core.DBNAME + "-wal",
                diskcache.core.DBNAME + "-shm",
            ):
                if (self.path / name).is_symlink():  # SQLite would open (and write) whatever it points to
                    raise StoreUnavailableError(
                        f"cannot open the store directory {str(self.path)!r}: its index file {name} is a symbolic "
                        "link; an index must be a plain file inside the store (remove the link)"
                    )
            limit = DEFAULT_DISK_MAX_BYTES if max_bytes is None else max_bytes
            self._cache = diskcache.Cache(
                str(self.path),
                size_limit=limit,
                eviction_policy="least-recently-used",
                disk=_BytesOnlyDisk,
                timeout=timeout_s,
            )
            self._identity = self._stat_index()
            if max_bytes is None:
                usable = shutil.disk_usage(self.path).free + int(self._cache.volume())
                limit = min(DEFAULT_DISK_MAX_BYTES, int(0.9 * usable))
                self._cache.reset("size_limit", limit)
        except StoreUnavailableError:
            raise
        except (*_FAULTS, ValueError) as exc:
            raise _open_error(self.path, exc) from exc
        self.max_bytes = limit  # diskcache size_limit
        self.hits = 0  # get() calls that returned a value
        self.misses = 0  # get() calls that found nothing
        self.corrupt = 0  # entries that failed to decode (or named a file outside) and were dropped
        self.read_errors = 0  # reads that failed with a storage fault (counted as misses by the caller)
        self.write_errors = 0  # writes that failed with a storage fault, or refused because the tier is lost
        self.lost = False  # the directory was deleted or replaced under us: no more writes
        self.orphans_removed = self._sweep_orphans()

    # ---------------------------------------------------------------------------------------- reading
    def get(self, key: str, decode: Callable[[bytes], T] | None = None) -> T | bytes | None:
        """The bytes under ``key`` (or ``decode(bytes)``), or ``None``; never raises a storage fault.

        An entry that is not raw bytes, names a file outside the directory, or whose ``decode`` raises
        ``CorruptEntryError`` is dropped (from the index; files outside are never touched), counted in
        ``corrupt``, and ``None`` is returned. A storage fault (full disk, I/O error, lock timeout) counts in
        ``read_errors`` and returns ``None``. Other exceptions of ``decode`` propagate. Marks the entry used.
        """
        try:
            data = self._cache.get(key, default=None)
            if data is None:
                self.misses += 1
                return None
            value = data if decode is None else decode(data)
        except CorruptEntryError as exc:
            self.corrupt += 1
            logger.warning("mmkv cache: dropping corrupt entry %s in %s: %s", key, self.path, exc)
            self.delete(key)
            return None
        except _FAULTS as exc:
            self.read_errors += 1
            logger.warning("mmkv cache: could not read %s from %s (recomputing): %s", key, self.path, exc)
            return None
        self.hits += 1
        return value

    def volume(self) -> int:
        """Bytes the directory occupies: SQLite pages plus value files (0 when it cannot be read)."""
        return self._quietly(lambda: int(self._cache.volume()), 0)

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is present (not validated). Changes no counter and not the LRU order."""
        return self._quietly(lambda: key in self._cache, False)

    def __len__(self) -> int:
        """Entries in the directory (0 when it cannot be read)."""
        return self._quietly(lambda: len(self._cache), 0)

    # ---------------------------------------------------------------------------------------- writing
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key``, replacing any previous value. Never raises a storage fault: a failed
        write (``ENOSPC``, read-only, lock timeout, directory gone) is counted in ``write_errors`` and logged.
        A value larger than ``max_bytes`` is not stored. Returns whether the value was written."""
        if type(data) is not bytes:
            raise TypeError(f"DiskTier stores bytes only, got {type(data).__name__}")
        if len(data) > self.max_bytes:
            return False
        if not self._still_there():
            self.write_errors += 1
            return False
        try:
            self._cache.set(key, data)
        except _FAULTS as exc:
            self.write_errors += 1
            logger.warning(
                "mmkv cache: could not write %s to %s (kept in memory only): %s", key, self.path, exc
            )
            return False
        return True

    def delete(self, key: str) -> bool:
        """Remove ``key`` if present (its value file too, if it is one of ours). Returns whether it was."""
        return self._quietly(lambda: bool(self._cache.delete(key)), False)

    def clear(self) -> None:
        """Remove every entry in the directory (for every process sharing it). Counters are kept."""
        self._quietly(lambda: self._cache.clear(), None)

    def close(self) -> None:
        """Close the SQLite connection (reopened on next use)."""
        self._quietly(self._cache.close, None)

    # ---------------------------------------------------------------------------------------- internals
    def _quietly(self, fn: Callable[[], T], fallback: T) -> T:
        try:
            return fn()
        except _FAULTS as exc:
            self.read_errors += 1
            logger.warning("mmkv cache: storage fault in %s: %s", self.path, exc)
            return fallback

    def _stat_index(self) -> tuple[int, int]:
        info = os.stat(self.path / diskcache.core.DBNAME)
        return info.st_dev, info.st_ino

    def _still_there(self) -> bool:
        """Whether the directory and the index we opened are still in place (else mark the tier lost)."""
        if self.lost:
            return False
        try:
            same = self._stat_index() == self._identity
        except OSError:
            same = False
        if not same:
            self.lost = True
            logger.warning(
                "mmkv cache: the store directory %s was deleted or replaced; its disk tier stops writing "
                "(reopen the store to use the new directory)",
                self.path,
            )
        return same

    def _sweep_orphans(self) -> int:
        """Remove value files no index row names, untouched for ``ORPHAN_AGE_S`` (a writer killed mid-write).
        Walks real folders only and unlinks by name in the folder it opened (see the module docstring).
        Returns how many were removed."""
        try:
            named = {
                row[0] for row in self._cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")
            }
            root = open_root(self.path)
            try:
                removed = sweep_orphans(root, named, time.time())
            finally:
                os.close(root)
            if removed:
                logger.info("mmkv cache: removed %d orphaned value files from %s", removed, self.path)
            return removed
        except _FAULTS as exc:
            logger.warning("mmkv cache: could not sweep %s for orphaned files: %s", self.path, exc)
            return 0
