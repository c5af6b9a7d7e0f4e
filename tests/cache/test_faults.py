"""Storage faults: a hostile index cannot make the store touch files outside it, opening fails clearly or
works, and once open no fault fails a turn (full disk, read-only, directory deleted, lock timeouts)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

import mmkv
from mmkv.cache import KVStore
from mmkv.cache.disk import DiskTier
from mmkv.cache.sweep import ORPHAN_AGE_S
from tests.conftest import random_image
from tests.helpers import BIG, point_row_at, sqlite_rows


@contextmanager
def _tmpfs(where: Path, size: str = "2m", options: str = ""):
    """A tmpfs of ``size`` mounted at ``where`` (root only; the test is skipped where mounting is refused)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}{',' + options if options else ''}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); CI runs as root and can")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory: Path) -> None:
    """Write a filler file until the file system is full."""
    with open(directory / f"filler-{uuid.uuid4().hex}", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


# -- item 1: index rows cannot reach outside the store -----------------------------------------------------


@pytest.mark.parametrize(
    "form",
    ["parent", "absolute", "nested-parent", "symlinked-directory", "odd-name-inside"],
)
def test_an_index_row_never_makes_the_store_read_or_delete_outside_it(tmp_path, form):
    """A row whose value file is ``../../x``, an absolute path, ``ab/cd/../../../x``, a valid-shaped name under a
    symlink to elsewhere, or an odd name: reading is a corrupt miss, the row leaves the index, the victim file
    stays byte-identical, and get / delete / clear / a new put all leave it alone."""
    store_dir, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_bytes(b"precious")
    tier = DiskTier(store_dir)
    assert tier.put("k", b"v" * BIG) and tier.put("other", b"w" * BIG)
    (_, good_name), *_ = [r for r in sqlite_rows(store_dir) if r[0] == "k"]
    # a top directory the two puts did not use (diskcache picks them at random: a fixed "ee" collided about
    # 2 times in 256)
    top = next(d for d in (f"{i:02x}" for i in range(256)) if not (store_dir / d).exists())
    names = {
        "parent": "../outside/victim.txt",
        "absolute": str(victim),
        "nested-parent": "ab/cd/../../../outside/victim.txt",
        "symlinked-directory": f"{top}/ff/" + "0" * 28 + ".val",
        "odd-name-inside": "victim.txt",
    }
    if form == "symlinked-directory":
        (store_dir / top).mkdir()
        (store_dir / top / "ff").symlink_to(outside)
        (outside / ("0" * 28 + ".val")).write_bytes(b"precious too")
        victim = outside / ("0" * 28 + ".val")
    if form == "odd-name-inside":
        victim = store_dir / "victim.txt"
        victim.write_bytes(b"precious")
    point_row_at(store_dir, "k", names[form])
    before = victim.read_bytes()
    tier = DiskTier(store_dir)
    assert tier.get("k") is None and tier.corrupt == 1
    assert "k" not in tier and victim.read_bytes() == before
    assert (store_dir / good_name).exists()  # the file the row used to name is only an orphan now
    assert tier.get("other") == b"w" * BIG  # the rest of the store is untouched
    point_row_at(store_dir, "other", names[form])  # delete and clear go through the same guard
    tier.delete("other")
    tier.clear()
    assert victim.read_bytes() == before and len(tier) == 0
    assert tier.put("k", b"x" * BIG) and tier.get("k") == b"x" * BIG


# -- items 2 and 3: opening fails clearly or works; once open, faults are counted --------------------------


def test_a_file_where_the_directory_should_be_is_a_clear_error(tmp_path):
    """A path that is a file: StoreUnavailableError naming it; the file is unchanged."""
    path = tmp_path / "store"
    path.write_bytes(b"not a directory")
    with pytest.raises(mmkv.StoreUnavailableError, match="is a file, not a directory"):
        KVStore(path)
    assert path.read_bytes() == b"not a directory"


@pytest.mark.parametrize("damage", ["garbage", "truncated-header"])
def test_a_corrupt_index_is_a_clear_error(tmp_path, damage):
    """cache.db overwritten with garbage or cut short: StoreUnavailableError saying the index is corrupt."""
    path = tmp_path / "store"
    DiskTier(path).put("k", b"v" * 10)
    index = path / "cache.db"
    data = index.read_bytes()
    index.write_bytes(b"\x00garbage" * 512 if damage == "garbage" else b"SQLite format 3\x00" + b"\xff" * 84)
    assert len(data) > 0
    with pytest.raises(mmkv.StoreUnavailableError, match="corrupt"):
        KVStore(path)


def test_a_read_only_store_is_a_clear_error_or_opens(tmp_path):
    """A store on a read-only mount: opening raises StoreUnavailableError (nothing written anywhere)."""
    with _tmpfs(tmp_path / "ro", "1m", "ro") as mount:
        with pytest.raises(mmkv.StoreUnavailableError, match="cannot open the store directory"):
            KVStore(mount / "store")
        assert list(mount.iterdir()) == []


def test_a_full_disk_fails_no_read_or_write_and_opening_says_so(tiny, tmp_path):
    """On a full tmpfs: hits and misses never raise (a fault is a counted miss), writes are counted, a turn's
    logits equal full recompute, and opening a new store there raises StoreUnavailableError "disk is full"."""
    with _tmpfs(tmp_path / "full", "3m") as mount:
        store = KVStore(mount / "store")
        assert store._disk.max_bytes <= 0.9 * (3 << 20)  # the default bound follows the free space
        image = random_image(5, (4, 6), tiny.processor.patch_size)
        warm = mmkv.Session(tiny, store=store)
        warm.add_image(image)
        warm.next_token_logits("first?")  # the image's KV is on disk
        _fill(mount)
        store._memory.clear()  # the next hit must come from the full disk
        session = mmkv.Session(tiny, store=store)
        session.add_text("another preamble")
        session.add_image(image)
        got = session.next_token_logits("What is it?")  # a disk hit updates access time: needs a write
        reference = session.fork(reuse="none").next_token_logits("What is it?")
        assert (got - reference).abs().max() <= 1e-4
        other = random_image(6, (2, 4), tiny.processor.patch_size)
        session.add_image(other)
        session.next_token_logits("And this?")  # a miss, then a write that cannot land
        stats = store.stats().disk
        assert stats.write_errors + stats.read_errors >= 1
        with pytest.raises(mmkv.StoreUnavailableError, match="disk is full"):
            KVStore(mount / "second")


def test_a_deleted_directory_stops_disk_writes_and_turns_go_on(tiny, tmp_path):
    """The directory removed mid-session: the next write is refused and counted (lost), nothing is recreated
    there, and turns still answer exactly as full recompute."""
    path = tmp_path / "store"
    store = KVStore(path)
    session = mmkv.Session(tiny, store=store)
    session.add_image(random_image(7, (4, 6), tiny.processor.patch_size))
    session.next_token_logits("first?")
    shutil.rmtree(path)
    session.add_image(random_image(8, (4, 4), tiny.processor.patch_size))
    got = session.next_token_logits("second?")
    assert store._disk.lost and store.stats().disk.write_errors >= 1 and not path.exists()
    assert (got - session.fork(reuse="none").next_token_logits("second?")).abs().max() <= 1e-4


def test_a_locked_index_is_a_counted_miss_within_the_timeout(tmp_path):
    """Another connection holds the SQLite write lock (for as long as the test runs): get and put give up after
    their 0.2 s timeout (counted), instead of blocking the turn. (That they return at all while the lock is
    held is the property: no clock is read.)"""
    tier = DiskTier(tmp_path / "store", timeout_s=0.2)
    tier.put("k", b"v" * 10)
    other = DiskTier(tmp_path / "store", timeout_s=0.2)
    assert other._cache.timeout == 0.2
    lock = sqlite3.connect(tmp_path / "store" / "cache.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        assert other.put("j", b"w" * 10) is False and other.write_errors == 1
        assert other.get("k") is None and other.read_errors == 1
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert other.get("k") == b"v" * 10


# -- item 11: orphaned value files are swept ---------------------------------------------------------------


def test_orphaned_value_files_are_swept_when_a_store_opens(tmp_path):
    """A value file no row names (a writer killed after writing it), older than ORPHAN_AGE_S, is removed at
    the next open; a fresh one (a write in progress elsewhere) and every named file are kept."""
    path = tmp_path / "store"
    tier = DiskTier(path)
    tier.put("k", b"v" * BIG)
    named = path / sqlite_rows(path)[0][1]
    old = path / "aa" / "bb" / ("1" * 28 + ".val")
    fresh = path / "aa" / "bb" / ("2" * 28 + ".val")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"half a record")
    fresh.write_bytes(b"being written")
    stale = time.time() - ORPHAN_AGE_S - 5
    os.utime(old, (stale, stale))
    os.utime(named, (stale, stale))
    reopened = DiskTier(path)
    assert reopened.orphans_removed == 1 and not old.exists()
    assert fresh.exists() and named.exists() and reopened.get("k") == b"v" * BIG


def test_a_kill_during_a_write_leaves_nothing_that_outlives_the_sweep(tmp_path):
    """A writer process killed (SIGKILL) in the middle of a large put (once its third value file exists, however
    long that takes): every value file left is either named by the index or removed by the next open's sweep
    once old enough; the index stays readable."""
    path = tmp_path / "store"
    DiskTier(path)
    code = (
        "import sys; from mmkv.cache.disk import DiskTier; t = DiskTier(sys.argv[1]);\n"
        "[t.put(f'k{i}', bytes([i % 256]) * 3_000_000) for i in range(1000)]"
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(path)])
    while len(list(path.glob("*/*/*.val"))) < 3 and writer.poll() is None:  # steps, not seconds
        time.sleep(0.01)
    writer.kill()
    writer.wait()
    assert len(sqlite_rows(path)) < 1000  # it was killed part-way
    stale = time.time() - ORPHAN_AGE_S - 5
    for file in path.glob("*/*/*.val"):
        os.utime(file, (stale, stale))
    tier = DiskTier(path)
    named = {name for _, name in sqlite_rows(path) if name}
    left = {f.relative_to(path).as_posix() for f in path.glob("*/*/*.val")}
    assert left == named, (left - named, tier.orphans_removed)
    for key, _ in sqlite_rows(path):
        data = tier.get(key)
        assert data is not None and len(set(data)) == 1 and len(data) == 3_000_000
