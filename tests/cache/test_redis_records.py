"""Hostile Redis records against a real redis-server: a manifest over its bounds is refused before any chunk
is fetched, and a key of the wrong type (a LIST, HASH, SET, ZSET or STREAM where a manifest or a chunk belongs)
is a corrupt entry: unlinked and counted, never a fault that skips the tier or fails later writes."""

from __future__ import annotations

import hashlib
import json

import pytest

from mmkv.cache.redis import MAX_CHUNKS, MAX_MANIFEST_BYTES, RedisTier
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

KEY = "f" * 64 + "/image/" + "d" * 64
BASE = "mmkv:" + KEY.replace("/", ":")
WRITE = "a" * 32
DATA = bytes(range(256)) * 40  # 10240 bytes: three chunks of 4096 at most


@pytest.fixture(scope="module")
def server():
    with RedisServer() as running:
        yield running


@pytest.fixture
def client(server):
    c = server.client()
    c.flushdb()
    c.config_resetstat()
    return c


def _tier(server) -> RedisTier:
    tier = RedisTier(server.url, timeout_s=2.0, chunk_bytes=4096, max_record_bytes=1 << 20)
    tier.retry_s = 3600.0  # a fault would show as a skipped tier for the rest of the test
    return tier


def _chunk_gets(client) -> int:
    """GET calls the server has answered since the last CONFIG RESETSTAT."""
    return client.info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def _manifest(chunks, length=None, **fields) -> bytes:
    body = {"version": 1, "key": KEY, "write": WRITE, "chunks": chunks,
            "length": sum(c[0] for c in chunks) if length is None else length}  # fmt: skip
    return json.dumps({**body, **fields}).encode()


SHA = hashlib.sha256(b"x").hexdigest()


def _hostile_manifests() -> dict[str, bytes]:
    many = [[1, SHA]] * 200_000
    return {
        "200k chunks": _manifest(many),  # ~14 MB: over the byte bound before it is even parsed
        "just over the chunk bound": _manifest([[1, SHA]] * (MAX_CHUNKS + 1)),
        "length over the record bound": _manifest([[2 << 20, SHA]]),
        "lengths that do not add up": _manifest([[1, SHA], [1, SHA]], length=5),
        "negative length": _manifest([[0, SHA]], length=-1),
        "padding over the byte bound": _manifest([[1, SHA]], pad="x" * (MAX_MANIFEST_BYTES + 10)),
        "no chunks": _manifest([]),
        "write id not a uuid": _manifest([[1, SHA]], write="../../x" * 3),
        "nesting 50k deep": b"[" * 50_000 + b"]" * 50_000,  # under the byte bound: parsed, refused
    }


@pytest.mark.parametrize("form", list(_hostile_manifests()))
def test_a_manifest_over_its_bounds_is_refused_before_any_chunk(server, client, form):
    """Each over-bound or inconsistent manifest: a miss counted as corrupt, the manifest unlinked, not one chunk
    GET sent, the tier still in use; a fresh write afterwards reads back byte for byte."""
    client.set(BASE + ":manifest", _hostile_manifests()[form])
    for i in range(3):
        client.set(f"{BASE}:{WRITE}:{i}", b"x")
    client.config_resetstat()
    tier = _tier(server)
    assert tier.get(KEY) is None and tier.corrupt == 1
    assert _chunk_gets(client) == 0
    assert not client.exists(BASE + ":manifest") and tier.available and tier.read_errors == 0
    assert tier.put(KEY, DATA) and tier.get(KEY) == DATA and tier.write_errors == 0


def _plant(client, name: str, kind: str) -> None:
    """A key ``name`` holding a value of Redis type ``kind``."""
    client.unlink(name)
    if kind == "list":
        client.rpush(name, b"a", b"b")
    elif kind == "hash":
        client.hset(name, mapping={"a": "b"})
    elif kind == "set":
        client.sadd(name, b"a")
    elif kind == "zset":
        client.zadd(name, {"a": 1.0})
    else:
        client.xadd(name, {"a": "b"})


KINDS = ["list", "hash", "set", "zset", "stream"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_manifest_key_of_the_wrong_type_is_a_corrupt_entry(server, client, kind):
    """The manifest key holds a LIST / HASH / SET / ZSET / STREAM: get misses and counts it corrupt, unlinks
    it, no read error, the tier is not skipped; the next put replaces it and reads back."""
    _plant(client, BASE + ":manifest", kind)
    tier = _tier(server)
    assert KEY in tier
    assert tier.get(KEY) is None and tier.corrupt == 1 and tier.read_errors == 0
    assert not client.exists(BASE + ":manifest") and tier.available
    assert tier.put(KEY, DATA) and tier.get(KEY) == DATA
    assert tier.write_errors == 0 and tier.read_errors == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_chunk_key_of_the_wrong_type_is_a_corrupt_entry(server, client, kind):
    """A valid record whose second chunk key was replaced by another type: a counted corrupt miss, the whole
    record (manifest and chunks) unlinked, the tier still in use."""
    tier = _tier(server)
    assert tier.put(KEY, DATA)
    write = json.loads(client.get(BASE + ":manifest"))["write"]
    _plant(client, f"{BASE}:{write}:1", kind)
    assert tier.get(KEY) is None and tier.corrupt == 1 and tier.read_errors == 0
    assert list(client.scan_iter(match="mmkv:*")) == [] and tier.available
    assert tier.put(KEY, DATA) and tier.get(KEY) == DATA


@pytest.mark.parametrize("kind", ["list", "hash", "stream"])
def test_writes_replace_a_wrong_typed_key_instead_of_failing(server, client, kind):
    """put over a manifest key of the wrong type: written (the bad key counted as corrupt), no write error, and
    every later write works too (no WRONGTYPE loop); delete of a wrong-typed key is no fault either."""
    tier = _tier(server)
    _plant(client, BASE + ":manifest", kind)
    assert tier.put(KEY, DATA) and tier.corrupt == 1 and tier.write_errors == 0
    assert tier.put(KEY, DATA[::-1]) and tier.get(KEY) == DATA[::-1]
    _plant(client, BASE + ":manifest", kind)
    assert tier.delete(KEY) and not client.exists(BASE + ":manifest") and tier.available


def test_records_over_the_bound_are_not_written(server, client):
    """A record over max_record_bytes is not written (so no reader ever has to refuse it)."""
    tier = _tier(server)
    assert tier.put(KEY, b"x" * ((1 << 20) + 1)) is False
    assert list(client.scan_iter(match="mmkv:*")) == [] and tier.write_errors == 0
