"""LivePool: exclusive checkouts, copies for partial matches, LRU eviction by bytes."""

from __future__ import annotations

import torch

import mmkv
from mmkv.serve.pool import PAGE, SAMPLE, LivePool


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


def _scan(pool: LivePool, layout) -> int:
    """What a linear scan over every idle entry finds: the longest exact prefix (0 below min_share)."""
    best = max((entry.matching_prefix(layout) for entry in pool._idle.values()), default=0)
    return best if best >= pool.min_share else 0


def test_the_page_index_finds_what_a_scan_of_every_entry_finds(tiny):
    """Random conversations sharing openings of several lengths (inside a page, at a page's edge, many pages):
    the indexed checkout keeps as many tokens as the best entry of a full scan, or at most a page fewer (it
    compares a bounded sample of the entries sharing the deepest page), and its copy holds matching ids."""
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
    openings = [" ".join(rng.choice(words) for _ in range(n)) for n in (1, 3, 8, 20)]
    pool = LivePool(tiny, max_bytes=1 << 30)
    for _ in range(24):
        pool.checkin(
            _live(tiny, f"{rng.choice(openings)} {' '.join(rng.choices(words, k=rng.randint(0, 12)))}")[1]
        )
    for i in range(30):
        probe = mmkv.Session(tiny)
        probe.add_text(f"{rng.choice(openings)} {' '.join(rng.choices(words, k=rng.randint(0, 12)))}")
        layout = probe.prompt_layout("q?")
        expected = _scan(pool, layout)
        live, keep = pool.checkout(layout)
        assert expected - (PAGE - 1) <= keep <= expected and (keep > 0) == (expected > 0), (
            i,
            keep,
            expected,
        )
        if keep:
            assert torch.equal(live.token_ids[:keep], layout.token_ids[:keep])
        pool.checkin(live)


def test_a_checkout_compares_only_entries_that_share_its_pages(tiny, monkeypatch):
    """Hundreds of idle conversations with other openings cost no exact comparison."""
    from mmkv.runtime.live import LiveCache

    pool = LivePool(tiny, max_bytes=1 << 30)
    for i in range(200):
        pool.checkin(_live(tiny, f"Conversation number {i} opens with its own words, and goes on.")[1])
    calls = []
    original = LiveCache.matching_prefix
    monkeypatch.setattr(
        LiveCache, "matching_prefix", lambda self, layout: calls.append(1) or original(self, layout)
    )
    probe = mmkv.Session(tiny)
    probe.add_text("Conversation number 7 opens with its own words, and goes on. A new turn.")
    live, keep = pool.checkout(probe.prompt_layout("q?"))
    assert keep > 20 and len(calls) <= SAMPLE + 1
    fresh = mmkv.Session(tiny)
    fresh.add_text("Something else entirely, never seen by this pool.")
    calls.clear()
    live, keep = pool.checkout(fresh.prompt_layout("q?"))
    assert (
        keep < 2 * PAGE and len(calls) <= SAMPLE
    )  # only the template's opening (Qwen2.5-VL: its default system)


def test_a_conversation_continues_its_own_entry_among_many_that_share_its_opening(tiny):
    """Agents with one system prompt: each next turn takes its own entry (no copy), however many share it."""
    pool = LivePool(tiny, max_bytes=1 << 30)
    sessions = []
    for i in range(40):
        session, live = _live(
            tiny, f"The shared system prompt of every agent here, long enough for pages. Agent {i}."
        )
        sessions.append((session, live))
        pool.checkin(live)
    for session, live in sessions[::7]:
        session.add_text("q?")
        session.add_text("an answer", role="assistant")
        taken, keep = pool.checkout(session.prompt_layout("next?"))
        assert taken is live and keep == live.num_tokens
