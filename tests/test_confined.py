"""mmkv.confined: open, create and unlink below a root without following a link; bounded reads."""

from __future__ import annotations

import os

import pytest

from mmkv.confined import (
    ConfinementError,
    create_file_beneath,
    open_file_beneath,
    open_root,
    read_bounded,
    unlink_beneath,
)


@pytest.fixture
def root(tmp_path):
    """A root holding ``d/f`` and a decoy ``outside/f`` beside it; yields (root path, descriptor, outside)."""
    (tmp_path / "root" / "d").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "d" / "f").write_bytes(b"inside")
    (tmp_path / "outside" / "f").write_bytes(b"decoy")
    fd = open_root(tmp_path / "root")
    yield tmp_path / "root", fd, tmp_path / "outside"
    os.close(fd)


@pytest.mark.parametrize("parts", [["..", "outside", "f"], ["d", "..", "..", "f"], ["", "f"], ["d/f"], ["."]])
def test_names_that_are_not_plain_are_refused(root, parts):
    """``..``, ``.``, empty names and names holding ``/`` are refused before anything is opened."""
    _, fd, _ = root
    with pytest.raises(ConfinementError, match="not a plain name"):
        open_file_beneath(fd, parts)


def test_unlinking_a_link_removes_the_link_never_its_target(root):
    """A file link, a folder link on the way: the link itself goes (file) or nothing goes (folder); the target
    keeps its bytes."""
    path, fd, outside = root
    (path / "d" / "link").symlink_to(outside / "f")
    assert unlink_beneath(fd, ["d", "link"]) and not (path / "d" / "link").is_symlink()
    (path / "x").symlink_to(outside)
    with pytest.raises(ConfinementError, match="symbolic link"):
        unlink_beneath(fd, ["x", "f"])
    assert (outside / "f").read_bytes() == b"decoy"


def test_creating_through_a_folder_link_is_refused(root):
    """A new file never lands outside through a planted folder link; an existing name is never overwritten."""
    path, fd, outside = root
    (path / "x").symlink_to(outside)
    with pytest.raises(ConfinementError, match="symbolic link"):
        create_file_beneath(fd, ["x", "new"], b"data")
    assert sorted(p.name for p in outside.iterdir()) == ["f"]
    with pytest.raises(FileExistsError):
        create_file_beneath(fd, ["d", "f"], b"data")
    create_file_beneath(fd, ["n1", "n2", "new"], b"data")
    assert (path / "n1" / "n2" / "new").read_bytes() == b"data"


def test_pruning_removes_emptied_folders_but_never_the_root(root):
    """prune=True removes the folders the unlink emptied, up to (not including) the root."""
    path, fd, _ = root
    assert unlink_beneath(fd, ["d", "f"], prune=True)
    assert not (path / "d").exists() and path.is_dir()
    assert unlink_beneath(fd, ["d", "f"]) is False


def test_bounded_reads_stop_one_byte_past_the_bound(root):
    """A file at the bound is read whole; one byte over gives None (the size is checked on the descriptor)."""
    path, fd, _ = root
    file = open_file_beneath(fd, ["d", "f"])
    try:
        assert read_bounded(file, 6) == b"inside"
        os.lseek(file, 0, os.SEEK_SET)
        assert read_bounded(file, 5) is None
    finally:
        os.close(file)
