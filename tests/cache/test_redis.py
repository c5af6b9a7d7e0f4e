"""The Redis tier against a real redis-server: byte-exact round trips, every corruption a miss (never wrong KV),
evictions under maxmemory, Redis killed and restarted, and two servers sharing one Redis."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import time

import pytest
import redis
import torch

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.cache.redis import RedisTier
from mmkv.kv import encode_images
from tests.conftest import random_image
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


def _warm(handle, store, image, text="A screen:"):
    """A session whose turn put ``image``'s KV into ``store``; returns the stored segment."""
    session = mmkv.Session(handle, store=store)
    session.add_text(text)
    session.add_image(image)
    session.next_token_logits("What is it?")
    return session


def _fresh(handle, url, **kwargs) -> KVStore:
    """A store over ``url`` only (nothing in memory yet)."""
    return KVStore(path=url, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_round_trip_byte_for_byte(tiny, redis_server, dtype):
    """A segment written by one store is read back by another, every tensor byte-identical (fp32 and bf16),
    split into several chunks when it is over the chunk size; the source reads "redis"."""
    segment = _warm(tiny, KVStore(), random_image(1, (4, 6), tiny.processor.patch_size)).live.segment(
        0, None, "image", "d" * 64
    )
    segment = mmkv.KVSegment(segment.keys.to(dtype), segment.values.to(dtype), segment.token_ids,
                             segment.position_ids, "image", "d" * 64, segment.rotary)  # fmt: skip
    writer = _fresh(tiny, redis_server.url)
    writer._tiers[0][1].chunk_bytes = 4096  # several chunks
    writer.put(segment.digest, segment, tiny)
    got, tier = _fresh(tiny, redis_server.url).lookup(segment.digest, tiny)
    assert tier == "redis" and got.keys.dtype == dtype
    for name in ("keys", "values", "token_ids", "position_ids"):
        assert torch.equal(getattr(got, name), getattr(segment, name))
    manifests = list(redis_server.client().scan_iter(match="mmkv:*:manifest"))
    assert len(manifests) == 1 and len(json.loads(redis_server.client().get(manifests[0]))["chunks"]) > 1


def test_deepstack_vision_outputs_round_trip(tiny_by_name, redis_server):
    """Qwen3-VL vision outputs with their DeepStack layers: identical after Redis."""
    handle = tiny_by_name["tiny-qwen3-vl"]
    image = random_image(2, (4, 6), handle.processor.patch_size)
    features = encode_images(handle, handle.processor.preprocess_images([image]))
    assert features[0].deepstack
    EncoderStore(path=redis_server.url).put("e" * 64, features, handle)
    got = EncoderStore(path=redis_server.url).get("e" * 64, handle)
    assert torch.equal(got[0].embeds, features[0].embeds)
    assert all(torch.equal(a, b) for a, b in zip(got[0].deepstack, features[0].deepstack, strict=True))


def _damage_each_way(client):
    """Ways to break the one stored record, each applied to a fresh copy."""
    manifest_key = next(iter(client.scan_iter(match="mmkv:*:manifest")))
    manifest = json.loads(client.get(manifest_key))
    base = manifest_key.decode()[: -len(":manifest")]
    chunk = f"{base}:{manifest['write']}:0"

    def flip():
        data = bytearray(client.get(chunk))
        data[len(data) // 2] ^= 0xFF
        client.set(chunk, bytes(data))

    def other_fingerprint():
        fingerprint = manifest["key"].split("/")[0]
        client.set(
            manifest_key, json.dumps(dict(manifest, key=manifest["key"].replace(fingerprint, "f" * 64)))
        )

    def short():
        client.set(chunk, client.get(chunk)[:-7])

    def lying_checksum():
        data = client.get(chunk)[:-1] + b"\x00"
        client.set(chunk, data)
        entry = [len(data), hashlib.sha256(b"not it").hexdigest()]
        client.set(manifest_key, json.dumps(dict(manifest, chunks=[entry, *manifest["chunks"][1:]])))

    return {
        "flipped byte": flip,
        "deleted chunk": lambda: client.unlink(chunk),
        "short chunk": short,
        "manifest of another fingerprint": other_fingerprint,
        "garbage manifest": lambda: client.set(manifest_key, b"\x00not json"),
        "checksum that lies": lying_checksum,
        "manifest key is a list": lambda: client.unlink(manifest_key) and client.rpush(manifest_key, b"x"),
        "chunk key is a hash": lambda: client.unlink(chunk) and client.hset(chunk, mapping={"a": "b"}),
        "manifest listing 200k chunks": lambda: client.set(
            manifest_key, json.dumps(dict(manifest, chunks=[manifest["chunks"][0]] * 200_000))
        ),
    }


@pytest.mark.parametrize(
    "damage",
    [
        "flipped byte",
        "deleted chunk",
        "short chunk",
        "manifest of another fingerprint",
        "garbage manifest",
        "checksum that lies",
        "manifest key is a list",
        "chunk key is a hash",
        "manifest listing 200k chunks",
    ],  # fmt: skip
)
def test_every_damaged_record_is_a_miss_and_is_removed(tiny, redis_server, damage):
    """A damaged record: the lookup misses, counts it corrupt, UNLINKs it, and the session computes the image
    itself, its logits equal to full recompute."""
    image = random_image(3, (4, 6), tiny.processor.patch_size)
    writer = _fresh(tiny, redis_server.url)
    writer._tiers[0][1].chunk_bytes = 4096
    _warm(tiny, writer, image)
    client = redis_server.client()
    _damage_each_way(client)[damage]()
    store = _fresh(tiny, redis_server.url)
    session = mmkv.Session(tiny, store=store)
    session.add_text("A screen:")
    session.add_image(image)
    logits = session.next_token_logits("What is it?")
    assert session.last_prefill.images[0].source == "computed"
    assert store.stats().redis.corrupt == 1 or damage == "manifest of another fingerprint"
    assert store.stats().redis.read_errors == 0 and store._tiers[0][1].available  # never a fault of the tier
    assert (logits - session.fork(reuse="none").next_token_logits("What is it?")).abs().max() <= 1e-4
    if damage != "manifest of another fingerprint":
        assert (
            not [k for k in client.scan_iter(match="mmkv:*") if b":manifest" in k]
            or store.stats().redis.corrupt
        )


class _CountingClient:
    """A redis client that counts the commands the tier sends: each can wait at most the socket timeout, so a
    count bounds how long a turn can be held by Redis without measuring the clock."""

    COMMANDS = frozenset({"get", "set", "exists", "pipeline", "unlink", "scan_iter", "info"})

    def __init__(self, inner) -> None:
        self._inner, self.commands = inner, 0

    def __getattr__(self, name):
        self.commands += name in self.COMMANDS
        return getattr(self._inner, name)


def _counted(store: KVStore, timeout_s: float) -> _CountingClient:
    """The store's Redis tier, its retry window made longer than any test and its commands counted; checks that
    every connect and command is bounded by ``timeout_s``."""
    tier = store._tiers[0][1]
    tier.retry_s = 3600.0
    tier._client = _CountingClient(tier._client)
    kwargs = tier._client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == timeout_s
    return tier._client


def test_an_unreachable_redis_never_blocks_or_fails_a_turn(tiny):
    """Redis absent at start: the store opens, the turn sends Redis one command (bounded by the 0.3 s socket
    timeout), then skips the tier (errors counted, writes skipped), and answers as full recompute."""
    server = RedisServer()  # a free port, never started
    store = KVStore(path=server.url, redis_timeout_s=0.3)
    client = _counted(store, 0.3)
    session = mmkv.Session(tiny, store=store)
    session.add_image(random_image(4, (4, 6), tiny.processor.patch_size))
    logits = session.next_token_logits("What is it?")
    assert client.commands == 1
    stats = store.stats().redis
    assert stats.read_errors + stats.write_errors >= 1
    assert (logits - session.fork(reuse="none").next_token_logits("What is it?")).abs().max() <= 1e-4


def test_redis_killed_mid_session_then_restarted_resumes_hits(tiny, redis_server):
    """kill -9 of Redis: the next turn still answers, after one command bounded by the socket timeout, errors
    counted; once it is back (restarted empty) and the retry window has passed, writes land again and another
    store gets redis hits."""
    patch = tiny.processor.patch_size
    store = KVStore(path=redis_server.url, redis_timeout_s=0.3)
    _warm(tiny, store, random_image(5, (4, 6), patch))
    client = _counted(store, 0.3)
    redis_server.kill()
    session = _warm(tiny, store, random_image(6, (2, 4), patch))
    assert client.commands == 1 and session.last_prefill.images[0].source == "computed"
    assert store.stats().redis.write_errors >= 1
    redis_server.start()  # same port, empty
    tier = store._tiers[0][1]
    assert not tier.available
    tier._down_until = time.monotonic()  # the retry window ends (it is only a time)
    image = random_image(7, (4, 4), patch)
    _warm(tiny, store, image)  # written to Redis again: the tier reconnected by itself
    hit = _warm(tiny, KVStore(path=redis_server.url), image)
    assert hit.last_prefill.images[0].source == "redis"


def _storm_worker(url: str, worker: int, rounds: int, out) -> None:
    """Write and read records under maxmemory; report any record that decoded to other bytes than written."""
    handle = mmkv.load("tiny-qwen3-vl", device="cpu")
    store = KVStore(path=url, max_bytes=0)  # no memory tier: every read goes to Redis
    store._tiers[0][1].chunk_bytes = 2048
    tenant = redis.Redis.from_url(url)
    wrong = hits = 0
    for r in range(rounds):
        for k in range(5):  # another tenant filling the memory, in step with the rounds (not with the clock)
            tenant.set(f"tenant:{worker}:{r}:{k}", b"x" * 100_000)
        image = random_image(1000 + (worker * rounds + r) % 12, (16, 24), handle.processor.patch_size)
        reference = mmkv.Session(handle, reuse="none")
        reference.add_text(f"Context {r % 3}:")
        reference.add_image(image)
        expected = reference.next_token_logits("What is it?")
        for _ in range(2):  # the second read usually finds what the first wrote, unless it was evicted since
            session = mmkv.Session(handle, store=store)
            session.add_text(f"Context {r % 3}:")
            session.add_image(image)
            logits = session.next_token_logits("What is it?")
            hits += session.last_prefill.images[0].source == "redis"
            # a wrong image's KV gives O(1) differences; a splice stored after another context, much less
            wrong += float((logits - expected).abs().max()) > 0.5
    out.put((worker, wrong, hits, store.stats().redis.corrupt))


def test_an_eviction_storm_under_maxmemory_serves_no_wrong_kv():
    """Two processes writing and reading under maxmemory 4mb with allkeys-lru, each also writing 500 KB of
    another tenant's keys per round (7 MB each in all: evictions are certain, whatever the speed): evicted or
    half-evicted records are misses, never another image's KV."""
    with RedisServer(maxmemory="4mb") as server:
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        workers = [context.Process(target=_storm_worker, args=(server.url, w, 14, out)) for w in range(2)]
        for w in workers:
            w.start()
        results = [out.get(timeout=3600) for _ in workers]  # a hang guard only
        for w in workers:
            w.join(timeout=600)
        info = server.client().info("stats")
    assert all(wrong == 0 for _, wrong, _, _ in results), results
    assert sum(hits for _, _, hits, _ in results) > 0  # records were read back from Redis, too
    assert info.get("evicted_keys", 0) > 0  # the storm did evict


def test_tier_order_and_promotion(tiny, redis_server, tmp_path):
    """--store DIR --store redis://: a record only in Redis is found there and promoted to memory; both tiers
    written on put; the source says which tier answered."""
    image = random_image(8, (4, 6), tiny.processor.patch_size)
    _warm(tiny, KVStore(path=redis_server.url), image)
    store = KVStore(path=[tmp_path / "disk", redis_server.url])
    session = _warm(tiny, store, image)
    assert session.last_prefill.images[0].source == "redis"
    again = _warm(tiny, store, image)
    assert again.last_prefill.images[0].source == "live" or again.last_prefill.images[0].source == "memory"
    assert set(store.stats().tiers) == {"memory", "disk", "redis"}


def test_redis_urls_with_password_and_tls_scheme_are_accepted():
    """redis-py reads rediss:// and passwords; mmkv passes them through (no connection made at open)."""
    tier = RedisTier("rediss://:secret@127.0.0.1:1/0", timeout_s=0.2)
    assert tier._client.connection_pool.connection_kwargs["password"] == "secret"
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:1/0", timeout_s=0)
