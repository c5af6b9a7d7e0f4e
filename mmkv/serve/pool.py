"""``LivePool``: the live caches a server keeps between stateless requests, matched by prefix.

Agents resend their whole history each turn; the pool keeps each conversation's last live cache so the next
request continues from it. ``checkout(layout)`` takes the idle entry whose ids and positions share the longest
prefix with the request's prompt, **exclusively** (it leaves the pool until ``checkin``):

- when the whole entry is a prefix of the request (the same conversation, one turn on), the entry itself is
  taken and extended;
- when only part of it matches (another conversation with the same system prompt, or one that branched), the
  matching part is **copied** into a new live cache and the entry stays in the pool untouched, so the
  conversation it belongs to still continues from it;
- with no useful match (fewer than ``min_share`` tokens), a fresh live cache.

Entries are evicted least recently used first once their KV bytes exceed the bound. Thread-safe (one lock); the
server's one model worker is its only user in practice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..kv.segment import segments_to_cache
from ..model.handle import ModelHandle
from ..prompt.layout import PromptLayout
from ..runtime.live import LiveCache

__all__ = ["LivePool"]


class LivePool:
    """Idle live caches, LRU by bytes (``max_bytes``); see the module docstring."""

    def __init__(self, handle: ModelHandle, max_bytes: int, min_share: int = 1) -> None:
        self.handle = handle
        self.max_bytes = max_bytes  # bound on the idle entries' KV bytes
        self.min_share = min_share  # fewer shared tokens than this: start fresh
        self._idle: OrderedDict[int, LiveCache] = OrderedDict()  # id -> entry, least recently used first
        self._lock = threading.Lock()
        self.hits = 0  # checkouts that continued an entry or a copy of its prefix
        self.evictions = 0

    def _nbytes(self, live: LiveCache) -> int:
        return live.num_tokens * self.handle.kv_bytes_per_token

    @property
    def num_entries(self) -> int:
        """Idle entries held."""
        return len(self._idle)

    @property
    def num_bytes(self) -> int:
        """KV bytes of the idle entries."""
        with self._lock:
            return sum(self._nbytes(e) for e in self._idle.values())

    def checkout(self, layout: PromptLayout) -> tuple[LiveCache, int]:
        """A live cache for ``layout`` and how many of its leading entries already match; the caller owns it
        until ``checkin``. Never hands one entry to two callers."""
        with self._lock:
            best, best_keep = None, 0
            for key, entry in self._idle.items():
                keep = entry.matching_prefix(layout)
                if keep > best_keep:
                    best, best_keep = key, keep
            if best is None or best_keep < self.min_share:
                return LiveCache(self.handle), 0
            entry = self._idle[best]
            self.hits += 1
            if best_keep >= entry.num_tokens:  # the same conversation, further on: continue it
                del self._idle[best]
                return entry, best_keep
            return self._copy_prefix(entry, best_keep), best_keep  # the entry stays for its own conversation

    def _copy_prefix(self, entry: LiveCache, keep: int) -> LiveCache:
        """A new live cache holding a copy of ``entry``'s first ``keep`` entries (``entry`` unchanged)."""
        live = LiveCache(self.handle)
        live.cache = segments_to_cache([entry.segment(0, keep)], self.handle.text_config)
        live.token_ids, live.positions = entry.token_ids[:keep].clone(), entry.positions[:, :keep].clone()
        live.pieces = tuple(p for p in entry.pieces if p.end <= keep)
        live.image_digests = {b: d for b, d in entry.image_digests.items() if b < keep}
        return live

    def checkin(self, live: LiveCache) -> None:
        """Give ``live`` back (most recently used), evicting the least recently used beyond the bound."""
        if live.num_tokens == 0:
            return
        with self._lock:
            self._idle[id(live)] = live
            self._idle.move_to_end(id(live))
            total = sum(self._nbytes(e) for e in self._idle.values())
            while total > self.max_bytes and self._idle:
                _, evicted = self._idle.popitem(last=False)
                total -= self._nbytes(evicted)
                self.evictions += 1

    def clear(self) -> None:
        """Drop every idle entry."""
        with self._lock:
            self._idle.clear()
