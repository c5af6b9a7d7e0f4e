"""The orphan sweep of a disk tier: value files no index row names, left by a writer killed mid-write.

It walks ``xx/yy/<28 hex>.val`` below the store's descriptor and never leaves the store: folders are listed with
``scandir`` without following links, each opened with ``O_NOFOLLOW`` and kept only when the opened folder is the
one listed (``st_dev`` / ``st_ino``), and a file is unlinked by name inside the folder that was opened, so a link
planted as a folder or a file, or swapped in between the listing and the act, leads nowhere outside.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

from ..confined import open_dir_beneath, same_object

__all__ = ["ORPHAN_AGE_S", "sweep_orphans"]

ORPHAN_AGE_S = 600.0  # a value file no row names, untouched this long, is a dead writer's leftover
_FOLDER_NAME = re.compile(r"[0-9a-f]{2}")  # each of the two folder levels
_FILE_NAME = re.compile(r"[0-9a-f]{28}\.val")  # a value file in its folder


def _subfolders(dir_fd: int) -> list[tuple[str, int]]:
    """``(name, descriptor)`` of each real two-hex-digit folder in ``dir_fd``: listed without following links,
    opened with ``O_NOFOLLOW`` and kept only when the opened folder is the one listed (a folder swapped for a
    link or for another folder in between is skipped). The caller closes the descriptors."""
    with os.scandir(dir_fd) as listing:
        entries = [e for e in listing if _FOLDER_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    opened = []
    for entry in entries:
        try:
            fd = open_dir_beneath(dir_fd, [entry.name])
        except OSError:  # ConfinementError included: it became a link
            continue
        if same_object(os.fstat(fd), entry.stat(follow_symlinks=False)):
            opened.append((entry.name, fd))
        else:
            os.close(fd)
    return opened


def sweep_orphans(root: int, named: set[str], now: float) -> int:
    """Unlink the regular files ``xx/yy/<28 hex>.val`` below the directory ``root`` (a descriptor) that
    ``named`` (index rows' file names) lacks and that are older than ``ORPHAN_AGE_S`` at ``now``; returns how
    many. Raises ``OSError`` when ``root`` cannot be listed."""
    removed = 0
    for first, first_fd in _subfolders(root):
        try:
            for second, second_fd in _subfolders(first_fd):
                try:
                    with os.scandir(second_fd) as listing:
                        files = [e for e in listing if _FILE_NAME.fullmatch(e.name)]
                    for entry in files:
                        info = entry.stat(follow_symlinks=False)
                        if f"{first}/{second}/{entry.name}" in named or not stat.S_ISREG(info.st_mode):
                            continue
                        if now - info.st_mtime >= ORPHAN_AGE_S:
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(entry.name, dir_fd=second_fd)  # this folder's name, never a target
                                removed += 1
                finally:
                    os.close(second_fd)
        finally:
            os.close(first_fd)
    return removed
