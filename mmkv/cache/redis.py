"""``RedisTier``: a store tier on Redis, shared by every server process that points at it.

A record (the same checksummed safetensors bytes the disk tier keeps) is split into chunks of at most
``chunk_bytes`` (16 MB: one big value would block Redis's single command thread) plus one **manifest written
last**: a JSON object with the format version, the record's key, length and chunk count, each chunk's length
and SHA-256, and a write id that names the chunks (two writers of one key never mix chunks). Keys::

    mmkv:{fingerprint}:{kind}:{digest}:manifest
    mmkv:{fingerprint}:{kind}:{digest}:{write id}:{i}

A read fetches the manifest (its type and at most ``MAX_MANIFEST_BYTES`` of it, in one round trip), checks it
**before fetching any chunk** (a format version, this key, a write id, a length within ``max_record_bytes``, at
most ``MAX_CHUNKS`` chunks whose lengths add up to it), then fetches every chunk in one round trip (a pipeline)
and checks each against the manifest. A missing, short or mismatched chunk, a manifest for another key, an
unparseable or over-bound one, or a key of the wrong type where a manifest or a chunk belongs (a LIST or a HASH:
Redis's WRONGTYPE) is a **miss**: the entry is removed (UNLINK), counted as corrupt, and the caller
recomputes; it is never a fault of the tier (no skipped tier, and the next write replaces it). So a record
half evicted under ``maxmemory`` with ``allkeys-lru`` is a miss, never wrong KV, and a hostile manifest costs
one bounded read. Entries expire after ``ttl_s`` when set.

Faults never fail a turn and never block for more than the socket timeout: Redis absent at start, killed, or
restarted is a counted error and a miss (or a skipped write); after an error the tier is skipped for
``retry_s`` and then tried again, so it reconnects by itself when Redis is back. No pickle anywhere.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from ..errors import StoreUnavailableError
from .codec import CorruptEntryError

__all__ = ["CHUNK_BYTES", "DEFAULT_MAX_RECORD_BYTES", "MANIFEST_VERSION", "MAX_CHUNKS", "MAX_MANIFEST_BYTES",
           "RedisTier"]  # fmt: skip

logger = logging.getLogger("mmkv.cache")

T = TypeVar("T")
CHUNK_BYTES = 16 << 20
MANIFEST_VERSION = 1
DEFAULT_MAX_RECORD_BYTES = 2 << 30  # larger records are neither written nor read (the memory tier's default)
MAX_CHUNKS = (
    1024  # chunks of one record (16 GiB at the default chunk size); a manifest listing more is corrupt
)
MAX_MANIFEST_BYTES = 4096 + 128 * MAX_CHUNKS  # a manifest's JSON, at most (about 80 bytes per chunk)
_WRITE_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _redis():
    """The redis-py module, imported when a Redis tier is first opened (it is optional: ``pip install redis``,
    or the ``redis`` extra). Raises ``StoreUnavailableError`` saying so when it is not installed."""
    try:
        import redis
    except ImportError as exc:
        raise StoreUnavailableError(
            "a redis:// store needs the redis package, which is not installed: pip install redis "
            "(or pip install 'mmkv[redis]')"
        ) from exc
    return redis


@functools.cache
def _faults() -> tuple[type[BaseException], ...]:
    """The errors that are storage faults (counted, served as misses), never raised to the caller."""
    errors = _redis().exceptions
    return errors.ConnectionError, errors.TimeoutError, errors.ResponseError, OSError


class RedisTier:
    """A map ``key -> bytes`` in Redis (see the module docstring). Counters are this object's own."""

    def __init__(
        self,
        url: str,
        ttl_s: float | None = None,
        timeout_s: float = 0.5,
        chunk_bytes: int = CHUNK_BYTES,
        retry_s: float = 1.0,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        """``url``: ``redis://[:password@]host:port/db`` or ``rediss://`` (TLS), as redis-py reads it.
        ``timeout_s`` bounds every connect and command (default 0.5 s). Never raises on an unreachable server
        (it counts the error and serves misses until it is back); ``ValueError`` for a malformed URL or bound."""
        if (
            not 0 < timeout_s <= 30
            or chunk_bytes < 1
            or (ttl_s is not None and ttl_s <= 0)
            or max_record_bytes < 1
        ):
            raise ValueError(
                "RedisTier needs 0 < timeout_s <= 30, chunk_bytes >= 1, max_record_bytes >= 1 and ttl_s > 0 or None"
            )
        self.url = url
        self.ttl_s, self.timeout_s, self.chunk_bytes, self.retry_s = ttl_s, timeout_s, chunk_bytes, retry_s
        self.max_record_bytes = max_record_bytes  # records over this are not written, and refused on read
        self._client = _redis().Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
            health_check_interval=0,
        )  # fmt: skip
        self._down_until = 0.0  # skip Redis until then, after an error
        self.hits = self.misses = self.corrupt = self.read_errors = self.write_errors = 0

    # ----------------------------------------------------------------------------------------------- keys
    @staticmethod
    def _base(key: str) -> str:
        """``"{fingerprint}/{kind}/{digest}"`` (a store key) -> ``"mmkv:{fingerprint}:{kind}:{digest}"``."""
        return "mmkv:" + key.replace("/", ":")

    @property
    def available(self) -> bool:
        """Whether the tier is tried now (False for ``retry_s`` after a fault)."""
        return time.monotonic() >= self._down_until

    def _fault(self, what: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self.retry_s
        logger.warning("mmkv cache: redis %s at %s failed (%s); local tiers only for %.1f s", what,
                       self._client.connection_pool.connection_kwargs.get("host"), exc, self.retry_s)  # fmt: skip

    # ---------------------------------------------------------------------------------------- reading
    def get(self, key: str, decode: Callable[[bytes], T] | None = None) -> T | bytes | None:
        """The bytes under ``key`` (or ``decode(bytes)``), or ``None``; see the module docstring. Never raises a
        Redis fault; other exceptions of ``decode`` propagate. A corrupt entry is unlinked and counted."""
        if not self.available:
            self.read_errors += 1
            return None
        base = self._base(key)
        try:
            raw = self._read_manifest(base)
            if raw is None:
                self.misses += 1
                return None
            manifest = self._manifest(raw, key, self.max_record_bytes)
            pipe = self._client.pipeline(transaction=False)
            for i in range(len(manifest["chunks"])):
                pipe.get(f"{base}:{manifest['write']}:{i}")
            chunks = [_string_reply(reply, "chunk") for reply in pipe.execute(raise_on_error=False)]
            data = self._join(chunks, manifest)
            value = data if decode is None else decode(data)
        except CorruptEntryError as exc:
            self.corrupt += 1
            logger.warning("mmkv cache: dropping corrupt redis entry %s: %s", key, exc)
            self.delete(key)
            return None
        except _faults() as exc:
            self.read_errors += 1
            self._fault("read", exc)
            return None
        self.hits += 1
        return value

    def _read_manifest(self, base: str) -> bytes | None:
        """The raw manifest of ``base`` (``None`` when there is none), read in one round trip that never moves
        more than ``MAX_MANIFEST_BYTES + 1`` bytes. Raises ``CorruptEntryError`` for a key of another type or a
        manifest over the bound; Redis faults propagate."""
        pipe = self._client.pipeline(transaction=False)
        pipe.type(base + ":manifest")
        pipe.getrange(base + ":manifest", 0, MAX_MANIFEST_BYTES)
        kind, raw = pipe.execute(raise_on_error=False)
        if isinstance(kind, Exception):
            raise kind
        if kind == b"none":
            return None
        if kind != b"string":
            raise CorruptEntryError(f"the manifest key holds a {kind.decode(errors='replace')}, not a string")
        raw = _string_reply(raw, "manifest")
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptEntryError(f"manifest over {MAX_MANIFEST_BYTES:,} bytes; not read further")
        return raw or None  # b"": it vanished between the two commands

    @staticmethod
    def _manifest(raw: bytes, key: str, max_record_bytes: int) -> dict:
        """The parsed manifest, checked whole before any chunk is fetched; ``CorruptEntryError`` otherwise."""
        try:
            manifest = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise CorruptEntryError(f"unparseable manifest ({str(exc)[:80]})") from None
        if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
            raise CorruptEntryError("manifest of an unknown format")
        if manifest.get("key") != key:
            raise CorruptEntryError(f"manifest for another entry ({str(manifest.get('key'))[:60]!r})")
        length, write, chunks = manifest.get("length"), manifest.get("write"), manifest.get("chunks")
        if type(length) is not int or not 0 <= length <= max_record_bytes:
            raise CorruptEntryError(
                f"manifest length {str(length)[:40]} is not within 0..{max_record_bytes:,}"
            )
        if not isinstance(write, str) or not _WRITE_ID.fullmatch(write):
            raise CorruptEntryError("manifest without a valid write id")
        if not isinstance(chunks, list) or not 1 <= len(chunks) <= MAX_CHUNKS:
            count = len(chunks) if isinstance(chunks, list) else "no"
            raise CorruptEntryError(
                f"manifest lists {count} chunks (1 to {MAX_CHUNKS} allowed); none fetched"
            )
        if not all(
            isinstance(c, list) and len(c) == 2 and type(c[0]) is int and c[0] >= 0 and isinstance(c[1], str)
            and _SHA256.fullmatch(c[1]) for c in chunks
        ):  # fmt: skip
            raise CorruptEntryError("manifest without a valid chunk list")
        if sum(c[0] for c in chunks) != length:
            raise CorruptEntryError("manifest chunk lengths do not add up to its length")
        return manifest

    @staticmethod
    def _join(chunks: list, manifest: dict) -> bytes:
        parts = []
        for index, (chunk, (length, sha)) in enumerate(zip(chunks, manifest["chunks"], strict=True)):
            if chunk is None:
                raise CorruptEntryError(f"chunk {index} is missing (evicted or deleted)")
            if len(chunk) != length or hashlib.sha256(chunk).hexdigest() != sha:
                raise CorruptEntryError(f"chunk {index} does not match its checksum")
            parts.append(chunk)
        return b"".join(parts)

    def __contains__(self, key: str) -> bool:
        """Whether a manifest for ``key`` exists (not validated). False when Redis is unreachable."""
        if not self.available:
            return False
        try:
            return bool(self._client.exists(self._base(key) + ":manifest"))
        except _faults() as exc:
            self.read_errors += 1
            self._fault("exists", exc)
            return False

    # ---------------------------------------------------------------------------------------- writing
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key``: chunks first, the manifest last (then the previous write's chunks are
        unlinked). A key of the wrong type in the way is replaced (counted as corrupt). A record over
        ``max_record_bytes`` or ``MAX_CHUNKS`` chunks is not written. Never raises a Redis fault (counted in
        ``write_errors``). Returns whether it was written."""
        if type(data) is not bytes:
            raise TypeError(f"RedisTier stores bytes only, got {type(data).__name__}")
        pieces = [data[i : i + self.chunk_bytes] for i in range(0, len(data), self.chunk_bytes)] or [b""]
        if len(data) > self.max_record_bytes or len(pieces) > MAX_CHUNKS:
            return False
        if not self.available:
            self.write_errors += 1
            return False
        base, write = self._base(key), uuid.uuid4().hex
        manifest = {
            "version": MANIFEST_VERSION, "key": key, "length": len(data), "write": write,
            "chunks": [[len(p), hashlib.sha256(p).hexdigest()] for p in pieces],
        }  # fmt: skip
        ttl = None if self.ttl_s is None else max(1, int(self.ttl_s))
        try:
            try:
                old = self._read_manifest(base)
            except CorruptEntryError as exc:  # SET below replaces a key of any type
                self.corrupt += 1
                logger.warning("mmkv cache: replacing corrupt redis entry %s: %s", key, exc)
                old = None
            pipe = self._client.pipeline(transaction=False)
            for index, piece in enumerate(pieces):
                pipe.set(f"{base}:{write}:{index}", piece, ex=ttl)
            pipe.execute()
            self._client.set(
                base + ":manifest", json.dumps(manifest), ex=ttl
            )  # last: the record is now whole
            if old is not None:
                self._unlink(self._chunk_names(base, old, keep=write))
        except _faults() as exc:
            self.write_errors += 1
            self._fault("write", exc)
            return False
        return True

    @staticmethod
    def _chunk_names(base: str, raw_manifest: bytes, keep: str | None = None) -> list[str]:
        """The chunk keys a (possibly damaged) manifest names, at most ``MAX_CHUNKS``; none for write ``keep``
        or when it names no valid write id."""
        try:
            old = json.loads(raw_manifest)
            write, count = old["write"], len(old["chunks"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            return []
        if not isinstance(write, str) or not _WRITE_ID.fullmatch(write) or write == keep:
            return []
        return [f"{base}:{write}:{i}" for i in range(min(count, MAX_CHUNKS))]

    def _unlink(self, names: list[str]) -> None:
        if names:
            self._client.unlink(*names)

    def delete(self, key: str) -> bool:
        """Remove ``key`` (manifest and the chunks it names; UNLINK), whatever type its keys hold. Returns
        whether a manifest was there."""
        if not self.available:
            return False
        base = self._base(key)
        try:
            try:
                raw = self._read_manifest(base)
                names = [] if raw is None else self._chunk_names(base, raw)
            except (
                CorruptEntryError
            ):  # a key of another type or an over-bound manifest: names no chunks we trust
                raw, names = b"", []
            self._unlink([base + ":manifest", *names])
            return raw is not None
        except _faults() as exc:
            self._fault("delete", exc)
            return False

    def clear(self) -> None:
        """Remove every mmkv key (``mmkv:*``) of this Redis database."""
        if not self.available:
            return
        try:
            batch = []
            for name in self._client.scan_iter(match="mmkv:*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    batch = []
            if batch:
                self._client.unlink(*batch)
        except _faults() as exc:
            self._fault("clear", exc)

    def close(self) -> None:
        self._client.close()

    def volume(self) -> int:
        """Bytes Redis reports in use (the whole server's ``used_memory``; 0 when unreachable)."""
        if not self.available:
            return 0
        try:
            return int(self._client.info("memory").get("used_memory", 0))
        except _faults():
            return 0

    def __len__(self) -> int:
        """Manifests present (a SCAN; 0 when unreachable)."""
        if not self.available:
            return 0
        try:
            return sum(1 for _ in self._client.scan_iter(match="mmkv:*:manifest", count=1000))
        except _faults():
            return 0


def _string_reply(reply, what: str) -> bytes | None:
    """A pipeline reply that should be a string (or nil): a WRONGTYPE error is a corrupt entry, any other error
    a fault (re-raised)."""
    if isinstance(reply, _redis().exceptions.ResponseError) and str(reply).startswith("WRONGTYPE"):
        raise CorruptEntryError(f"the {what} key holds another type than a string")
    if isinstance(reply, Exception):
        raise reply
    return reply
