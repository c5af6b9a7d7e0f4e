"""The disk tier and symbolic links: the orphan sweep, reads, deletes and writes never follow a link out of the
store, whether it was planted before the store opened or swapped in between a check and the act. Decoys
outside the store are named like value files and dated like orphans; they must keep their bytes and times."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mmkv import confined
from mmkv.cache import disk, sweep
from mmkv.cache.disk import DiskTier
from mmkv.cache.sweep import ORPHAN_AGE_S
from mmkv.errors import StoreUnavailableError
from tests.helpers import BIG, point_row_at, sqlite_rows

NAME = "0" * 28 + ".val"  # a value file's name
DECOY = b"DECOY outside the store"


def _age(path: Path) -> None:
    """Date ``path`` (not what a link points to) as an orphan's."""
    stale = time.time() - ORPHAN_AGE_S - 60
    os.utime(path, (stale, stale), follow_symlinks=False)


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def places(tmp_path):
    """(store, outside): a store with one real, aged orphan at ``aa/bb/1...1.val``, and a folder of aged decoys
    outside it laid out like a store (``bb/NAME``, ``NAME``)."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    DiskTier(store).close()
    orphan = store / "aa" / "bb" / ("1" * 28 + ".val")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"half a record")
    _age(orphan)
    (outside / "bb").mkdir(parents=True)
    for decoy in (outside / NAME, outside / "bb" / NAME):
        decoy.write_bytes(DECOY)
        _age(decoy)
    return store, outside


@pytest.mark.parametrize("form", ["first-level folder link", "second-level folder link", "file link"])
def test_the_sweep_never_follows_a_planted_link(places, form):
    """A folder link at either level, or a value-file link, to aged decoys: the sweep removes the real orphan
    and nothing outside (the decoys keep bytes and times); a file link is left alone, its target untouched."""
    store, outside = places
    if form == "first-level folder link":
        (store / "cc").symlink_to(outside)
    elif form == "second-level folder link":
        (store / "aa" / "dd").symlink_to(outside)
    else:
        (store / "aa" / "bb" / NAME).symlink_to(outside / NAME)
        _age(store / "aa" / "bb" / NAME)
    before = _snapshot(outside)
    tier = DiskTier(store)
    assert tier.orphans_removed == 1 and not (store / "aa" / "bb" / ("1" * 28 + ".val")).exists()
    assert _snapshot(outside) == before


def test_a_folder_swapped_for_a_link_between_listing_and_opening_is_skipped(places, monkeypatch):
    """``aa/bb`` is a real folder when listed and a link to the decoys when the sweep opens it: skipped, the
    decoys untouched."""
    store, outside = places
    real_open = sweep.open_dir_beneath

    def racing_open(dir_fd, parts, create=False):
        if parts == ["bb"] and not (store / "aa" / "bb.real").exists():
            (store / "aa" / "bb").rename(store / "aa" / "bb.real")
            (store / "aa" / "bb").symlink_to(outside)
        return real_open(dir_fd, parts, create)

    monkeypatch.setattr(sweep, "open_dir_beneath", racing_open)
    before = _snapshot(outside)
    assert DiskTier(store).orphans_removed == 0
    assert _snapshot(outside) == before and (store / "aa" / "bb.real" / ("1" * 28 + ".val")).exists()


def test_a_folder_swapped_after_it_was_opened_is_swept_where_it_was_opened(places, monkeypatch):
    """``aa/bb`` becomes a link to the decoys after the sweep opened it: the unlink acts on the opened folder
    (its orphan goes), never on the decoys the link now names."""
    store, outside = places
    real_subfolders = sweep._subfolders

    def racing_subfolders(dir_fd):
        opened = real_subfolders(dir_fd)
        if [name for name, _ in opened] == ["bb"]:
            (store / "aa" / "bb").rename(store / "aa" / "bb.real")
            (store / "aa" / "bb").symlink_to(outside)
        return opened

    monkeypatch.setattr(sweep, "_subfolders", racing_subfolders)
    (outside / ("1" * 28 + ".val")).write_bytes(DECOY)  # a decoy under the orphan's own name
    _age(outside / ("1" * 28 + ".val"))
    before = _snapshot(outside)
    assert DiskTier(store).orphans_removed == 1
    assert not (store / "aa" / "bb.real" / ("1" * 28 + ".val")).exists()
    assert _snapshot(outside) == before


def _plant(store: Path, outside: Path, form: str, monkeypatch) -> str:
    """Put the fault ``form`` in place (again, if a delete removed it); returns the value-file name a row should
    hold."""
    name = "ee/ff/" + NAME
    (store / "ee" / "ff").mkdir(parents=True, exist_ok=True)
    target = store / "ee" / "ff" / NAME
    if form == "file link" and not target.is_symlink():
        target.symlink_to(outside / NAME)
    elif form == "first-level folder link":
        name = "gg/bb/" + NAME
        if not (store / "gg").is_symlink():
            (store / "gg").symlink_to(outside)
    elif form == "fifo" and not target.exists():
        os.mkfifo(target)
    elif form == "swapped before the open":
        target.write_bytes(b"inside")
        (outside / "swapped" / "ff").mkdir(parents=True, exist_ok=True)
        (outside / "swapped" / "ff" / NAME).write_bytes(DECOY)
        real_open_at = confined._open_at

        def racing_open_at(dir_fd, part, flags, mode=0o644):
            if part == "ee" and not (store / "ee").is_symlink():
                (store / "ee").rename(store / f"ee.{time.monotonic_ns()}")
                (store / "ee").symlink_to(outside / "swapped")
            return real_open_at(dir_fd, part, flags, mode)

        monkeypatch.setattr(confined, "_open_at", racing_open_at)
    return name


@pytest.mark.parametrize("form", ["file link", "first-level folder link", "fifo", "swapped before the open"])
def test_a_row_naming_a_link_or_a_fifo_is_corrupt_and_never_read(places, form, monkeypatch):
    """An index row whose (well-shaped) value file is a link to a decoy, lies under a folder link, is a FIFO
    (would block a plain open), or whose folder is swapped for a link right before the open: a corrupt miss,
    the row dropped, the decoy neither returned nor changed by get, delete or clear."""
    store, outside = places
    tier = DiskTier(store)
    for number, key in enumerate(("k", "other"), start=1):
        assert tier.put(key, b"v" * BIG)
        name = _plant(store, outside, form, monkeypatch)
        point_row_at(store, key, name)
        before = _snapshot(outside)
        assert tier.get(key) is None and tier.corrupt == number and key not in tier
        assert _snapshot(outside) == before
        if form == "swapped before the open":
            monkeypatch.undo()
            (store / "ee").unlink()  # the planted link; its target stays
    assert tier.put("k", b"w" * BIG) and tier.get("k") == b"w" * BIG
    tier.clear()
    assert _snapshot(outside) == before and (outside / NAME).read_bytes() == DECOY


def test_a_write_never_lands_through_a_planted_folder_link(places, monkeypatch):
    """A value file whose folder is a link to elsewhere: the write is refused (counted, kept in memory only),
    nothing is created outside; the next write elsewhere succeeds."""
    store, outside = places
    (store / "hh").symlink_to(outside)
    tier = DiskTier(store)
    real_filename = disk._BytesOnlyDisk.filename
    monkeypatch.setattr(
        disk._BytesOnlyDisk, "filename", lambda self, *a: ("hh/bb/" + "2" * 28 + ".val", None)
    )
    before = _snapshot(outside)
    assert tier.put("k", b"v" * BIG) is False and tier.write_errors == 1
    assert _snapshot(outside) == before and sorted(p.name for p in (outside / "bb").iterdir()) == [NAME]
    monkeypatch.setattr(disk._BytesOnlyDisk, "filename", real_filename)
    assert tier.put("k", b"v" * BIG) and tier.get("k") == b"v" * BIG
    assert all(not name.startswith("hh/") for _, name in sqlite_rows(store) if name)


@pytest.mark.parametrize("name", ["cache.db", "cache.db-wal", "cache.db-shm"])
def test_an_index_file_that_is_a_link_is_refused_at_open(tmp_path, name):
    """The SQLite index (or its WAL / shared-memory file) planted as a link to a decoy: opening the store raises
    StoreUnavailableError naming it, and SQLite never opens (or writes) the decoy."""
    store, decoy = tmp_path / "store", tmp_path / "decoy"
    DiskTier(store).close()
    decoy.write_bytes(DECOY)
    (store / name).unlink(missing_ok=True)
    (store / name).symlink_to(decoy)
    before = decoy.stat().st_mtime_ns
    with pytest.raises(StoreUnavailableError, match=f"its index file {name} is a symbolic link"):
        DiskTier(store)
    assert decoy.read_bytes() == DECOY and decoy.stat().st_mtime_ns == before
