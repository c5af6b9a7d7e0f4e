"""Store directories before any store opens: ``check_store_directory`` (can one be created and written?) and
``open_error``, the ``StoreUnavailableError`` that says why one could not be opened. Imports nothing heavy, so
``mmkv serve`` checks its ``--store`` directories before torch loads."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from ..errors import StoreUnavailableError

__all__ = ["check_store_directory", "open_error"]


def open_error(path: Path, exc: BaseException) -> StoreUnavailableError:
    """The ``StoreUnavailableError`` that says why ``path`` could not be opened."""
    where = f"cannot open the store directory {str(path)!r}"
    if path.exists() and not path.is_dir():
        return StoreUnavailableError(f"{where}: it is a file, not a directory; pass a directory path")
    if isinstance(exc, sqlite3.DatabaseError) and ("not a database" in str(exc) or "malformed" in str(exc)):
        return StoreUnavailableError(
            f"{where}: its index {str(path / 'cache.db')!r} is corrupt ({exc}); move the directory away or "
            "delete it (the store rebuilds itself)"
        )
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        return StoreUnavailableError(f"{where}: no permission to write there; choose a writable directory")
    code = getattr(exc, "errno", None)
    if code in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR) and not path.is_dir():
        return StoreUnavailableError(
            f"{where}: it cannot be created there ({os.strerror(code)}); choose a writable directory"
        )
    probe = path if path.exists() else path.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    if (
        getattr(exc, "errno", None) == errno.ENOSPC
        or free == 0
        or "full" in str(exc)
        or (free is not None and free < (1 << 20) and "I/O" in str(exc))
    ):
        return StoreUnavailableError(
            f"{where}: the disk is full ({free} bytes free); free some space, or use a memory-only store "
            "(path=None)"
        )
    return StoreUnavailableError(f"{where}: {type(exc).__name__}: {exc}")


def check_store_directory(path: Path) -> None:
    """Create the store directory ``path`` if needed (as opening a store would) and check that a file can be
    written there (a probe file, removed at once). Raises ``StoreUnavailableError`` saying what is wrong (a
    file in the way, no permission, read-only, full); changes nothing else. For checks before a model loads."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mmkv-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise open_error(path, exc) from None
