"""The image stores: disk round trips, the memory bound, corruption, model isolation, sharing, disk-full writes."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import struct
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import diskcache
import numpy as np
import pytest
import torch

from mmkv.cache import EncoderStore, KVStore, image_digest
from mmkv.kv import ImageFeatures, KVSegment, encode_images, image_span, prefill_span, text_span
from tests.conftest import random_image, random_text_ids


def _image_segment(handle, seed: int = 0) -> KVSegment:
    """The KV segment of a (4, 6)-grid noise image at start 3, named by the image's digest."""
    pil = random_image(seed, (4, 6), handle.processor.patch_size)
    inputs = handle.processor.preprocess_images([pil])
    ids, pos = image_span(handle, inputs.image_grid_thw[0], 3)
    return prefill_span(
        handle, ids, pos, images=inputs, digest=image_digest(pil, handle.processor, handle.fingerprint)
    ).segment


@pytest.fixture
def segment(tiny) -> KVSegment:
    """One image segment of the tiny model (a few KiB: stored inside diskcache's SQLite file)."""
    return _image_segment(tiny)


def _assert_same_segment(a: KVSegment, b: KVSegment) -> None:
    for name in ("keys", "values", "token_ids", "position_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.kind, a.digest) == (b.kind, b.digest)


def _only_key(path: Path) -> str:
    """The single key of the diskcache directory ``path`` (opened with diskcache's own defaults)."""
    with diskcache.Cache(str(path)) as cache:
        keys = list(cache.iterkeys())
    assert len(keys) == 1
    return keys[0]


def _payload_middle(data: bytes) -> int:
    (header,) = struct.unpack("<Q", data[:8])
    return 8 + header + (len(data) - 8 - header) // 2


# -- round trips through the disk tier ------------------------------------------------------------------------


def test_disk_round_trip_is_bit_exact(tiny, segment, tmp_path):
    """A segment put by one store is read back bit-exact by a new store on the same directory (memory empty)."""
    KVStore(tmp_path).put(segment.digest, segment, tiny)
    fresh = KVStore(tmp_path)
    assert fresh.stats().memory.entries == 0
    back = fresh.get(segment.digest, tiny)
    assert back is not None and back.rotary is tiny.rotary
    _assert_same_segment(back, segment)
    stats = fresh.stats()
    assert (stats.memory.misses, stats.disk.hits, stats.memory.entries) == (1, 1, 1)  # promoted to memory
    assert fresh.get(segment.digest, tiny) is back and fresh.stats().memory.hits == 1


def test_lookup_names_the_tier_that_answered(tiny, segment, tmp_path):
    """lookup returns (value, "disk") for a record read from disk, then (value, "memory"), (None, None) if absent."""
    KVStore(tmp_path).put(segment.digest, segment, tiny)
    store = KVStore(tmp_path)
    from_disk, tier = store.lookup(segment.digest, tiny)
    assert tier == "disk" and from_disk is not None
    assert store.lookup(segment.digest, tiny) == (from_disk, "memory")
    assert store.lookup("0" * 64, tiny) == (None, None)
    stats = store.stats()
    assert (stats.memory.hits, stats.memory.misses, stats.disk.hits, stats.disk.misses) == (1, 2, 1, 1)


def test_bfloat16_disk_round_trip_is_bit_exact(tiny, segment, tmp_path):
    """bfloat16 K/V survive the disk tier byte for byte."""
    bf16 = replace(segment, keys=segment.keys.to(torch.bfloat16), values=segment.values.to(torch.bfloat16))
    KVStore(tmp_path).put(bf16.digest, bf16, tiny)
    back = KVStore(tmp_path).get(bf16.digest, tiny)
    assert back is not None and back.keys.dtype == torch.bfloat16
    _assert_same_segment(back, bf16)


def test_features_disk_round_trip(tiny, tmp_path):
    """Vision-tower outputs (3 DeepStack tensors on tiny-qwen3-vl) survive the disk tier bit-exact."""
    pil = random_image(1, (4, 6), tiny.processor.patch_size)
    features = encode_images(tiny, tiny.processor.preprocess_images([pil]))
    digest = image_digest(pil, tiny.processor, tiny.fingerprint)
    EncoderStore(tmp_path).put(digest, features, tiny)
    back = EncoderStore(tmp_path).get(digest, tiny)
    assert back is not None and len(back) == 1
    assert len(back[0].deepstack) == (3 if tiny.family.has_deepstack else 0)
    for got, want in zip(
        (back[0].embeds, *back[0].deepstack), (features[0].embeds, *features[0].deepstack), strict=True
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_kv_and_encoder_stores_share_a_directory(tiny, segment, tmp_path):
    """A segment and the features of the same digest live side by side in one directory under distinct keys."""
    features = [ImageFeatures(embeds=torch.ones(6, 4), deepstack=())]
    KVStore(tmp_path).put(segment.digest, segment, tiny)
    EncoderStore(tmp_path).put(segment.digest, features, tiny)
    assert KVStore(tmp_path).get(segment.digest, tiny) is not None
    back = EncoderStore(tmp_path).get(segment.digest, tiny)
    assert back is not None and torch.equal(back[0].embeds, features[0].embeds)
    assert KVStore(tmp_path).stats().disk.entries == 2


def test_memory_only_store(tiny, segment):
    """Without a path there is no disk tier: stats().disk is None and values are held in memory only."""
    store = KVStore()
    assert store.get(segment.digest, tiny) is None
    store.put(segment.digest, segment, tiny)
    assert store.get(segment.digest, tiny) is segment
    stats = store.stats()
    assert stats.disk is None and (stats.memory.hits, stats.memory.misses, stats.memory.entries) == (1, 1, 1)


def test_put_rejects_a_segment_named_otherwise(tiny, segment):
    """put raises ValueError when the segment's own digest differs from the key, and stores nothing."""
    store = KVStore()
    with pytest.raises(ValueError, match="digest"):
        store.put("0" * 64, segment, tiny)
    assert not store.contains("0" * 64, tiny) and store.stats().memory.entries == 0


# -- the memory bound -------------------------------------------------------------------------------------------


def test_memory_eviction_respects_the_byte_bound(tiny, segment):
    """With room for 2.5 segments, at most 2 are held and the least recently used one leaves first."""
    max_bytes = int(2.5 * segment.nbytes)
    store = KVStore(max_bytes=max_bytes)
    a, b, c, d = (replace(segment, digest=f"{i:064x}") for i in range(4))
    store.put(a.digest, a, tiny)
    store.put(b.digest, b, tiny)
    assert store.get(a.digest, tiny) is a  # a is now more recent than b
    store.put(c.digest, c, tiny)
    assert [store.contains(s.digest, tiny) for s in (a, b, c)] == [True, False, True]
    store.put(d.digest, d, tiny)  # a (touched before c went in) is now the oldest
    assert [store.contains(s.digest, tiny) for s in (a, c, d)] == [False, True, True]
    stats = store.stats().memory
    assert stats.evictions == 2 and stats.entries == 2
    assert stats.bytes == 2 * segment.nbytes <= max_bytes


def test_value_larger_than_the_memory_bound_is_not_held(tiny, segment, tmp_path):
    """A segment over max_bytes is not held in memory (nothing is evicted for it) but still goes to disk."""
    store = KVStore(tmp_path, max_bytes=segment.nbytes - 1)
    store.put(segment.digest, segment, tiny)
    stats = store.stats()
    assert (stats.memory.entries, stats.memory.bytes, stats.memory.evictions) == (0, 0, 0)
    assert stats.disk.entries == 1 and store.get(segment.digest, tiny) is not None


# -- corruption -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_record_is_detected_and_dropped(tiny, segment, tmp_path, damage):
    """A record truncated or with one payload byte flipped (written through diskcache) reads as a miss:
    counted once as corrupt, deleted, then an ordinary miss; a recomputed put serves again."""
    KVStore(tmp_path).put(segment.digest, segment, tiny)
    key = _only_key(tmp_path)
    assert key.startswith(tiny.fingerprint) and key.endswith(segment.digest)
    with diskcache.Cache(str(tmp_path)) as cache:
        data = cache[key]
        if damage == "truncate":
            cache[key] = data[: len(data) // 2]
        else:
            flipped = bytearray(data)
            flipped[_payload_middle(data)] ^= 0x40
            cache[key] = bytes(flipped)
    store = KVStore(tmp_path)
    assert store.get(segment.digest, tiny) is None
    stats = store.stats().disk
    assert (stats.corrupt, stats.hits, stats.entries) == (1, 0, 0)
    assert store.get(segment.digest, tiny) is None
    stats = store.stats().disk
    assert (stats.corrupt, stats.misses) == (1, 1)
    store.put(segment.digest, segment, tiny)  # the caller recomputed
    _assert_same_segment(KVStore(tmp_path).get(segment.digest, tiny), segment)


def test_truncated_value_file_is_detected(tiny, tmp_path):
    """A record over 32 KiB lives in its own .val file; truncating that file on disk reads as corrupt."""
    ids, pos = text_span(random_text_ids(tiny, np.random.default_rng(0), 80), 0)
    big = prefill_span(tiny, ids, pos, digest="a" * 64).segment
    assert big.nbytes > 40_000
    KVStore(tmp_path).put(big.digest, big, tiny)
    files = list(Path(tmp_path).rglob("*.val"))
    assert len(files) == 1
    os.truncate(files[0], files[0].stat().st_size // 2)
    store = KVStore(tmp_path)
    assert store.get(big.digest, tiny) is None
    assert store.stats().disk.corrupt == 1 and not files[0].exists()
    assert store.get(big.digest, tiny) is None and store.stats().disk.misses == 1


def test_missing_value_file_is_a_miss_and_a_new_put_repairs_it(tiny, tmp_path):
    """A .val file deleted behind diskcache's back reads as a plain miss; the recomputed put writes it again."""
    ids, pos = text_span(random_text_ids(tiny, np.random.default_rng(1), 80), 0)
    big = prefill_span(tiny, ids, pos, digest="c" * 64).segment
    KVStore(tmp_path).put(big.digest, big, tiny)
    (file,) = Path(tmp_path).rglob("*.val")
    file.unlink()
    store = KVStore(tmp_path)
    assert store.get(big.digest, tiny) is None and store.stats().disk.misses == 1
    store.put(big.digest, big, tiny)
    _assert_same_segment(KVStore(tmp_path).get(big.digest, tiny), big)


class _Tripwire:
    """Unpickling this creates ``marker``: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_entry_is_never_unpickled(tiny, segment, tmp_path):
    """An entry diskcache stored pickled (someone else wrote an object under our key) is dropped as corrupt
    without being unpickled."""
    KVStore(tmp_path).put(segment.digest, segment, tiny)
    key = _only_key(tmp_path)
    marker = tmp_path / "unpickled"
    with diskcache.Cache(str(tmp_path)) as cache:
        cache[key] = _Tripwire(marker)
    store = KVStore(tmp_path)
    assert store.get(segment.digest, tiny) is None
    assert not marker.exists()
    assert store.stats().disk.corrupt == 1 and store.stats().disk.entries == 0


# -- model isolation --------------------------------------------------------------------------------------------


def test_entries_are_never_served_to_another_model(tiny_by_name, tmp_path, caplog):
    """Model B never finds model A's entry; A's bytes forged under B's key are rejected as corrupt
    (fingerprint mismatch)."""
    a, b = tiny_by_name["tiny-qwen2.5-vl"], tiny_by_name["tiny-qwen3-vl"]
    assert a.fingerprint != b.fingerprint
    seg = _image_segment(a)
    KVStore(tmp_path).put(seg.digest, seg, a)
    store = KVStore(tmp_path)
    assert not store.contains(seg.digest, b)
    assert store.get(seg.digest, b) is None
    assert (store.stats().disk.misses, store.stats().disk.corrupt) == (1, 0)
    key_a = _only_key(tmp_path)
    key_b = key_a.replace(a.fingerprint, b.fingerprint)
    assert key_b != key_a
    with diskcache.Cache(str(tmp_path)) as cache:
        cache[key_b] = cache[key_a]
    store = KVStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mmkv.cache"):
        assert store.get(seg.digest, b) is None
    assert store.stats().disk.corrupt == 1 and "fingerprint mismatch" in caplog.text
    assert store.get(seg.digest, a) is not None  # A's own entry is untouched


# -- sharing between processes ----------------------------------------------------------------------------------

_WORKERS = 2
_RECORDS = 20
_FINGERPRINT = "5" * 64


def _stand_in_handle() -> SimpleNamespace:
    """What the stores read from a handle (fingerprint, device): enough for EncoderStore, no model needed."""
    return SimpleNamespace(fingerprint=_FINGERPRINT, device=torch.device("cpu"))


def _record(worker: int, index: int) -> tuple[str, list[ImageFeatures]]:
    """The digest and the features record ``index`` of ``worker``, derived from a seed."""
    gen = torch.Generator().manual_seed(1000 * worker + index)
    embeds = torch.randn(5, 8, generator=gen)  # (pads, hidden)
    deepstack = (torch.randn(5, 8, generator=gen).to(torch.bfloat16),)  # one (pads, hidden) layer
    return f"{worker:02d}-{index:02d}", [ImageFeatures(embeds=embeds, deepstack=deepstack)]


def _same_features(a: list[ImageFeatures], b: list[ImageFeatures]) -> bool:
    """Same number of images and, per image, bit-identical embeds and DeepStack tensors (dtype included)."""
    tensors_a = [(f.embeds, *f.deepstack) for f in a]
    tensors_b = [(f.embeds, *f.deepstack) for f in b]
    if [len(t) for t in tensors_a] != [len(t) for t in tensors_b]:
        return False
    pairs = [(x, y) for ta, tb in zip(tensors_a, tensors_b, strict=True) for x, y in zip(ta, tb, strict=True)]
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)


def _share_worker(path: str, worker: int, written, results) -> None:
    """Put this worker's records one by one, reading the other workers' after each put; once every worker has
    written all of its records (a barrier: steps, not seconds), read whatever is still unseen once more."""
    store, handle = EncoderStore(path), _stand_in_handle()
    others = {_record(w, i)[0]: (w, i) for w in range(_WORKERS) if w != worker for i in range(_RECORDS)}
    seen, wrong = set(), 0

    def read_others() -> None:
        nonlocal wrong
        for digest, (w, i) in others.items():
            if digest not in seen and (got := store.get(digest, handle)) is not None:
                seen.add(digest)
                wrong += not _same_features(got, _record(w, i)[1])

    for index in range(_RECORDS):
        store.put(*_record(worker, index), handle)
        read_others()
    written.wait(timeout=3600)  # a hang guard only
    read_others()
    results.put((worker, _RECORDS, len(seen), wrong, store.stats().disk.write_errors))


def test_two_processes_share_one_directory(tmp_path):
    """Two processes writing and reading one directory concurrently see all 40 records, byte-identical."""
    ctx = multiprocessing.get_context("spawn")
    results, written = ctx.Queue(), ctx.Barrier(_WORKERS)
    procs = [
        ctx.Process(target=_share_worker, args=(str(tmp_path), w, written, results)) for w in range(_WORKERS)
    ]
    for proc in procs:
        proc.start()
    reports = sorted(results.get(timeout=3600) for _ in procs)  # hang guards only
    for proc in procs:
        proc.join(timeout=600)
        assert proc.exitcode == 0
    assert reports == [(w, _RECORDS, _RECORDS * (_WORKERS - 1), 0, 0) for w in range(_WORKERS)]
    store, handle = EncoderStore(tmp_path), _stand_in_handle()
    assert store.stats().disk.entries == _WORKERS * _RECORDS
    for w in range(_WORKERS):
        for i in range(_RECORDS):
            digest, features = _record(w, i)
            got = store.get(digest, handle)
            assert got is not None and _same_features(got, features), digest


# -- disk full, contains, clear ---------------------------------------------------------------------------------


def test_disk_full_write_is_counted_not_raised(tiny, segment, tmp_path, monkeypatch, caplog):
    """ENOSPC on the disk write: put does not raise, write_errors == 1, and memory still serves the segment."""
    store = KVStore(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store._disk._cache, "set", disk_full)
    with caplog.at_level(logging.WARNING, logger="mmkv.cache"):
        store.put(segment.digest, segment, tiny)
    assert store.stats().disk.write_errors == 1 and "No space left" in caplog.text
    assert store.get(segment.digest, tiny) is segment
    assert store.stats().memory.hits == 1 and store.stats().disk.entries == 0
    assert KVStore(tmp_path).get(segment.digest, tiny) is None  # nothing reached the directory


def test_contains_changes_no_counter(tiny, segment, tmp_path):
    """contains answers for memory, disk-only and absent entries without touching any counter."""
    KVStore(tmp_path).put(segment.digest, segment, tiny)
    store = KVStore(tmp_path)
    before = store.stats()
    assert store.contains(segment.digest, tiny)  # on disk only
    assert not store.contains("0" * 64, tiny)
    assert store.stats() == before
    store.get(segment.digest, tiny)  # now in memory as well
    before = store.stats()
    assert store.contains(segment.digest, tiny) and not store.contains("0" * 64, tiny)
    assert store.stats() == before


def test_clear_empties_both_tiers(tiny, segment, tmp_path):
    """clear drops every entry from memory and from the directory; a new store finds nothing."""
    store = KVStore(tmp_path)
    other = replace(segment, digest="b" * 64)
    store.put(segment.digest, segment, tiny)
    store.put(other.digest, other, tiny)
    assert store.stats().memory.entries == 2 and store.stats().disk.entries == 2
    store.clear()
    stats = store.stats()
    assert (stats.memory.entries, stats.memory.bytes, stats.disk.entries) == (0, 0, 0)
    assert not store.contains(segment.digest, tiny) and not store.contains(other.digest, tiny)
    assert KVStore(tmp_path).get(segment.digest, tiny) is None
    with diskcache.Cache(str(tmp_path)) as cache:
        assert len(cache) == 0
