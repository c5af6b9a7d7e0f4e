"""``LivePool``: the live caches a server keeps between stateless requests, matched by prefix.

Agents resend their whole history each turn; the pool keeps each conversation's last live cache so the next
request continues from it. ``checkout(layout)`` takes the idle entry whose ids and positions share the longest
prefix with the request's prompt, **exclusively** (it leaves the pool until ``checkin``):

- when the entry's whole last prompt is a prefix of the request (the same conversation, one turn on; the
  client may resend its previous answer in other tokens than the ones decoded), the entry itself is taken
  (``run_turn`` cuts what no longer matches) and extended;
- when only part of its prompt matches (another conversation with the same system prompt, or one that
  branched), the matching part is **copied** into a new live cache and the entry stays in the pool untouched,
  so the conversation it belongs to still continues from it;
- with no useful match (fewer than ``min_share`` tokens, at least one page), a fresh live cache.

Finding the entry costs O(prompt pages + candidates), not O(entries): every idle entry is indexed by the chained
hashes of its full ``PAGE``-token pages (ids and positions), as a prefix cache indexes its pages. A checkout
walks the request's chain while some entry shares it, then compares exactly (``LiveCache.matching_prefix``:
ids, positions and image digests) a bounded number of the entries that share the deepest pages (see
``_best``): the match found is the longest, or within one page of it. So a server holding thousands of idle
conversations matches about as fast as one holding ten (a linear scan cost ~0.5 ms per entry: 0.4 s per request
at 500 entries).

Entries are evicted least recently used first once their KV bytes exceed the bound. Thread-safe (one lock); the
server's one model worker is its only user in practice.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from collections import OrderedDict
from collections.abc import Iterator

import torch

from ..model.handle import ModelHandle
from ..prompt.layout import PromptLayout
from ..runtime.live import LiveCache

__all__ = ["PAGE", "SAMPLE", "LivePool", "page_chain"]

PAGE = 16  # tokens per indexed page (a "page": the pool's unit of prefix hashing, not a message block)
SAMPLE = 8  # entries compared exactly per level beyond those ending there


def page_chain(token_ids: torch.Tensor, positions: torch.Tensor) -> Iterator[bytes]:
    """Chained hashes of the full ``PAGE``-token pages of ``token_ids`` ``(L,)`` and ``positions`` ``(3, L)``,
    made lazily (a walk that stops early hashes no further): page k's hash covers pages 0..k, so equal hashes
    mean equal prefixes (up to hash collisions, which the exact comparison after it catches).

    >>> ids, pos = torch.arange(40), torch.arange(40).expand(3, 40)
    >>> chain = list(page_chain(ids, pos))
    >>> len(chain), chain[0] == next(page_chain(ids[:16], pos[:, :16]))
    (2, True)
    """
    pages = int(token_ids.shape[0]) // PAGE
    ids = token_ids[: pages * PAGE].to(torch.int64).numpy()
    pos = positions[:, : pages * PAGE].to(torch.int64).numpy()
    previous = b""
    for k in range(pages):
        piece = slice(k * PAGE, (k + 1) * PAGE)
        previous = hashlib.blake2b(
            previous + ids[piece].tobytes() + pos[:, piece].tobytes(), digest_size=16
        ).digest()
        yield previous


class LivePool:
    """Idle live caches, LRU by bytes (``max_bytes``); see the module docstring."""

    def __init__(self, handle: ModelHandle, max_bytes: int, min_share: int = PAGE) -> None:
        self.handle = handle
        self.max_bytes = max_bytes  # bound on the idle entries' KV bytes
        self.min_share = max(PAGE, min_share)  # fewer shared tokens than this: start fresh
        self._idle: OrderedDict[int, LiveCache] = OrderedDict()  # id -> entry, least recently used first
        self._chains: dict[int, list[bytes]] = {}  # id -> its page chain
        self._index: dict[bytes, set[int]] = {}  # page-chain hash -> ids of the entries holding that prefix
        self._used: dict[int, int] = {}  # id -> checkin stamp (larger: more recent)
        self._bytes: dict[int, int] = {}  # id -> its KV bytes, as checked in
        self._total = 0  # sum of _bytes
        self._clock = 0
        self._lock = threading.Lock()
        self.hits = 0  # checkouts that continued an entry or a copy of its prefix
        self.evictions = 0

    @property
    def num_entries(self) -> int:
        """Idle entries held."""
        return len(self._idle)

    @property
    def num_bytes(self) -> int:
        """KV bytes of the idle entries (kept as a running total: O(1))."""
        return self._total

    def checkout(self, layout: PromptLayout) -> tuple[LiveCache, int]:
        """A live cache for ``layout`` and how many of its leading entries already match (exactly
        ``LiveCache.matching_prefix(layout)``: hand it to ``run_turn``, which then does not compute it again);
        the caller owns the cache until ``checkin``. Never hands one entry to two callers."""
        with self._lock:
            best, best_keep = self._best(layout)
            if best is None or best_keep < self.min_share:
                return LiveCache(self.handle), 0
            entry = self._idle[best]
            self.hits += 1
            if best_keep >= entry.prompt_tokens:  # the same conversation, further on: continue it
                self._remove(best)
                return entry, best_keep
            return entry.copy_prefix(best_keep), best_keep  # the entry stays for its own conversation

    def _best(self, layout: PromptLayout) -> tuple[int | None, int]:
        """An idle entry sharing a long exact prefix with ``layout`` (among those sharing at least a page) and
        that length. Caller holds the lock.

        Entries sharing the request's deepest shared page share it within ``PAGE - 1`` tokens of each other, so
        at that level: an entry the request continues whole (one whose chain ends there) is taken at once;
        otherwise the best of at most ``SAMPLE`` of them, most recently used first, is within a page of the
        best of all. Shallower levels are visited only while one of theirs could still match longer.
        """
        levels: list[set[int]] = []  # levels[k]: entries sharing the request's pages 0..k
        for digest in page_chain(layout.token_ids, layout.positions):
            holders = self._index.get(digest)
            if not holders:
                break
            levels.append(holders)
        best, best_keep, seen = None, 0, set()
        for k in range(len(levels) - 1, -1, -1):
            fresh = levels[k] - seen
            ends_here = [key for key in fresh if len(self._chains[key]) == k + 1]
            for key in sorted(ends_here, key=self._used.__getitem__, reverse=True):
                keep = self._idle[key].matching_prefix(layout)
                if keep >= self._idle[key].prompt_tokens:  # the request continues this entry's conversation
                    return key, keep
                if keep > best_keep:
                    best, best_keep = key, keep
            for key in heapq.nlargest(SAMPLE, fresh.difference(ends_here), key=self._used.__getitem__):
                keep = self._idle[key].matching_prefix(layout)
                if keep > best_keep:
                    best, best_keep = key, keep
            seen |= levels[k]
            if best_keep >= (k + 1) * PAGE - 1:  # the rest share at most k pages: fewer tokens than that
                break
        return best, best_keep

    def _add(self, key: int, live: LiveCache) -> None:
        self._clock += 1
        self._used[key] = self._clock
        self._bytes[key] = live.num_tokens * self.handle.kv_bytes_per_token
        self._total += self._bytes[key]
        chain = list(page_chain(live.token_ids, live.positions))
        self._chains[key] = chain
        for digest in chain:
            self._index.setdefault(digest, set()).add(key)

    def _remove(self, key: int) -> LiveCache:
        self._used.pop(key, None)
        self._total -= self._bytes.pop(key, 0)
        for digest in self._chains.pop(key, ()):
            holders = self._index.get(digest)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._index[digest]
        return self._idle.pop(key)

    def checkin(self, live: LiveCache) -> None:
        """Give ``live`` back (most recently used), evicting the least recently used beyond the bound."""
        if live.num_tokens == 0:
            return
        with self._lock:
            key = id(live)
            if key in self._idle:
                self._remove(key)
            self._idle[key] = live
            self._add(key, live)
            while self._total > self.max_bytes and self._idle:
                self._remove(next(iter(self._idle)))
                self.evictions += 1

    def clear(self) -> None:
        """Drop every idle entry."""
        with self._lock:
            self._idle.clear()
            self._chains.clear()
            self._index.clear()
            self._used.clear()
            self._bytes.clear()
            self._total = 0
