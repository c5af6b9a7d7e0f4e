"""LivePool: exclusive checkouts, copies for partial matches, LRU eviction by bytes."""

from __future__ import annotations

import torch

import mmkv
from mmkv.serve.pool import LivePool


def _live(handle, text: str) -> tuple[mmkv.Session, object]:
    session = mmkv.Session(handle)
    session.add_text(text)
    session.next_token_logits("q?")
    return session, session.live


def test_checkout_is_exclusive_and_partial_matches_work_on_a_copy(tiny):
    """The entry a prompt extends is taken out of the pool; a prompt sharing only part of it gets a copy and
    leaves the entry (bit for bit) for its own conversation."""
    pool = LivePool(tiny, max_bytes=1 << 30)
    session, live = _live(tiny, "The same opening words, then conversation A.")
    before = live.segment()
    pool.checkin(live)
    other = mmkv.Session(tiny)
    other.add_text("The same opening words, then conversation B.")
    copy, keep = pool.checkout(other.prompt_layout("q?"))
    assert 0 < keep < live.num_tokens and copy is not live and copy.num_tokens == keep
    assert pool.num_entries == 1 and torch.equal(live.segment().keys, before.keys)
    assert torch.equal(copy.segment().keys, before.keys[:, :, :, :keep])
    session.add_text("q?")
    session.add_text("an answer", role="assistant")  # the next request: the history, the answer, a new turn
    taken, keep = pool.checkout(session.prompt_layout("next?"))
    assert taken is live and pool.num_entries == 0  # the same conversation continues its own entry
    again, keep = pool.checkout(session.prompt_layout("next?"))
    assert again is not live and keep == 0  # nobody else gets it while it is out


def test_idle_entries_are_evicted_least_recently_used_by_bytes(tiny):
    """Over the byte bound, the least recently checked-in entries go first."""
    lives = [_live(tiny, f"conversation {i} " * 5)[1] for i in range(3)]
    pool = LivePool(tiny, max_bytes=2 * lives[0].num_tokens * tiny.kv_bytes_per_token + 1)
    for live in lives:
        pool.checkin(live)
    assert pool.num_entries == 2 and pool.evictions == 1
    assert pool.num_bytes <= pool.max_bytes
