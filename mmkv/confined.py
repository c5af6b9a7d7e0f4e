"""Files under a root directory, opened, created, read and deleted without ever leaving it.

A path is checked and acted on in one step: each component is opened relative to the descriptor of the one
before (``dir_fd``) with ``O_NOFOLLOW``, so a symbolic link anywhere below the root (a folder, a file, or one
swapped in between a check and the open) is refused instead of followed, and the caller reads, writes or
unlinks exactly the object it opened. This is what ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` gives on
recent Linux, written with calls every POSIX system has.

The root itself is opened by its path (links above it are its owner's choice). Components are names, never
``..``, ``.``, empty or containing ``/``. Used by the disk tier (value files) and the server's ``file://`` images.

    root = open_root("/srv/media")
    fd = open_file_beneath(root, ["shots", "a.png"])   # ConfinementError if "shots" is a link
    data = read_bounded(fd, 20 << 20)                  # None when the file holds more
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

__all__ = [
    "ConfinementError",
    "create_file_beneath",
    "open_dir_beneath",
    "open_file_beneath",
    "open_root",
    "read_bounded",
    "same_object",
    "unlink_beneath",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO never blocks
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class ConfinementError(OSError):
    """A path that cannot be followed without possibly leaving the root: a component that is a symbolic link,
    ``..`` / ``.`` / empty / holds a ``/``, or a final object that is not a regular file (a FIFO, a device)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ELOOP, message)


def open_root(path: str | os.PathLike) -> int:
    """A descriptor of the directory ``path`` (links in ``path`` itself are followed). Raises ``OSError``."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))


def _check_name(name: str) -> None:
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ConfinementError(f"path component {name!r} is not a plain name")


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_at(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int:
    """``openat(dir_fd, name, flags | O_NOFOLLOW)``; a link there raises ``ConfinementError``."""
    _check_name(name)
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR) and _is_link(dir_fd, name):
            raise ConfinementError(f"{name!r} is a symbolic link; links are not followed") from None
        raise


def open_dir_beneath(root_fd: int, parts: Sequence[str], create: bool = False) -> int:
    """A new descriptor of the directory ``root/parts[0]/.../parts[-1]`` (``root_fd`` itself, duplicated, for no
    parts), every component opened without following a link. ``create``: missing components are made (mode
    0o755). Raises ``ConfinementError`` for a link or a bad name, ``OSError`` otherwise (``ENOENT``, ``ENOTDIR``).
    The caller closes the result."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            if create:
                _check_name(name)
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            inner = _open_at(fd, name, _DIR_FLAGS)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file_beneath(root_fd: int, parts: Sequence[str]) -> int:
    """A read-only descriptor of the regular file ``root/parts...``, no link followed anywhere below the root.
    Raises ``ConfinementError`` for a link, a bad name or something other than a regular file (checked with
    ``fstat`` on the opened descriptor), ``OSError`` otherwise. The caller closes the result."""
    if not parts:
        raise ConfinementError("no file name below the root")
    directory = open_dir_beneath(root_fd, parts[:-1])
    try:
        fd = _open_at(directory, parts[-1], _FILE_FLAGS)
    finally:
        os.close(directory)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfinementError(f"{parts[-1]!r} is not a regular file")
    return fd


def create_file_beneath(root_fd: int, parts: Sequence[str], data: bytes) -> None:
    """Create the new file ``root/parts...`` (its folders too) holding ``data``; never through a link, never over
    an existing name (``FileExistsError``). Raises ``ConfinementError`` / ``OSError``."""
    directory = open_dir_beneath(root_fd, parts[:-1], create=True)
    try:
        fd = _open_at(directory, parts[-1], _CREATE_FLAGS)
    finally:
        os.close(directory)
    with os.fdopen(fd, "wb") as writer:
        writer.write(data)


def unlink_beneath(root_fd: int, parts: Sequence[str], prune: bool = False) -> bool:
    """Unlink the name ``root/parts...`` (a link there is removed itself, never its target; a folder on the way
    that is a link is refused). ``prune``: then remove the folders on the way that became empty (never the
    root). Returns whether a name was removed; ``False`` when it was already gone. Raises
    ``ConfinementError``."""
    if not parts:
        raise ConfinementError("no file name below the root")
    _check_name(parts[-1])
    try:
        directory = open_dir_beneath(root_fd, parts[:-1])
    except FileNotFoundError:
        return False
    try:
        os.unlink(parts[-1], dir_fd=directory)
        removed = True
    except FileNotFoundError:
        removed = False
    finally:
        os.close(directory)
    for depth in range(len(parts) - 1, 0, -1) if prune else ():
        try:
            parent = open_dir_beneath(root_fd, parts[: depth - 1])
        except OSError:
            break
        try:
            os.rmdir(parts[depth - 1], dir_fd=parent)  # only an empty real folder goes; a link is ENOTDIR
        except OSError:
            break
        finally:
            os.close(parent)
    return removed


def read_bounded(fd: int, max_bytes: int) -> bytes | None:
    """Everything ``fd`` holds, or ``None`` when that is more than ``max_bytes`` (never reads more than one byte
    past the bound, even from a file that grows). Does not close ``fd``."""
    if os.fstat(fd).st_size > max_bytes:
        return None
    chunks, total = [], 0
    while total <= max_bytes:
        chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return None if total > max_bytes else b"".join(chunks)


def same_object(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two ``stat`` results describe the same file (device and inode)."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
