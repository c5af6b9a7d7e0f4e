"""``DecodeBatch``: rows of different lengths decode together as each would alone; one row is exactly the
single-sequence call; leaving hands a row's KV back; misuse is refused."""

from __future__ import annotations

import pytest
import torch

from mmkv.engine import DecodeBatch
from mmkv.runtime import LiveCache, TurnPolicy, run_turn
from tests.engine.conftest import Stores, conversation


def _prefilled(handle, k: int) -> LiveCache:
    session = conversation(handle, k, images=1 + k % 2)
    live = LiveCache(handle)
    run_turn(
        handle,
        live,
        session.prompt_layout(None),
        session.images,
        Stores(handle).turn_stores(TurnPolicy(reuse="none")),
        TurnPolicy(),
    )
    return live


def _copy(handle, live: LiveCache) -> LiveCache:
    return live.copy_prefix(live.num_tokens)


def test_rows_of_different_lengths_decode_as_each_alone(tiny):
    """Three rows (different lengths, positions past their token counts: images), three steps: each row's
    logits match that sequence decoded alone within 1e-5, and after leaving its cache holds the same entries."""
    lives = [_prefilled(tiny, k) for k in range(3)]
    alone = [_copy(tiny, live) for live in lives]
    assert len({live.num_tokens for live in lives}) == 3
    assert all(live.next_position < live.num_tokens for live in lives)  # images take fewer positions
    batch = DecodeBatch(tiny)
    for live in lives:
        batch.join(live)
    assert batch.padding > 0
    positions = [live.next_position for live in lives]
    with torch.inference_mode():
        for step in range(3):
            tokens = [20 + 3 * b + step for b in range(3)]
            logits = batch.step(tokens, [p + step for p in positions])  # (3, vocab)
            for b, single in enumerate(alone):
                expected = single.extend(torch.tensor([tokens[b]]), torch.full((3, 1), positions[b] + step))
                assert (logits[b] - expected).abs().max() < 1e-5
    for live, single in zip(lives, alone, strict=True):
        batch.leave(live)
        assert torch.equal(live.token_ids, single.token_ids) and torch.equal(live.positions, single.positions)
        for a, b in zip(live.cache.layers, single.cache.layers, strict=True):
            assert a.keys.shape == b.keys.shape and (a.keys - b.keys).abs().max() < 1e-5
    assert len(batch) == 0 and batch.width == 0


def test_one_row_is_the_single_sequence_call_bit_for_bit(tiny):
    """A batch of one row (no padding, no mask) gives exactly the logits of ``LiveCache.extend``."""
    live = _prefilled(tiny, 1)
    single = _copy(tiny, live)
    batch = DecodeBatch(tiny)
    batch.join(live)
    position = live.next_position
    with torch.inference_mode():
        got = batch.step([42], [position])[0]
        expected = single.extend(torch.tensor([42]), torch.full((3, 1), position))
    assert torch.equal(got, expected)


def test_a_row_leaving_mid_run_leaves_the_others_as_they_were(tiny):
    """The middle row leaves after one step; the other two go on as if it had never been there (1e-5)."""
    lives = [_prefilled(tiny, k) for k in range(3)]
    alone = [_copy(tiny, live) for live in (lives[0], lives[2])]
    batch = DecodeBatch(tiny)
    for live in lives:
        batch.join(live)
    p = [live.next_position for live in lives]
    with torch.inference_mode():
        batch.step([5, 6, 7], p)
        batch.leave(lives[1])
        for single, token, position in zip(alone, (5, 7), (p[0], p[2]), strict=True):
            single.extend(torch.tensor([token]), torch.full((3, 1), position))
        logits = batch.step([8, 9], [p[0] + 1, p[2] + 1])
        for b, (single, token, position) in enumerate(zip(alone, (8, 9), (p[0] + 1, p[2] + 1), strict=True)):
            expected = single.extend(torch.tensor([token]), torch.full((3, 1), position))
            assert (logits[b] - expected).abs().max() < 1e-5
    assert lives[1].token_ids[-1] == 6  # its one decoded token came back with it


def test_misuse_is_refused_and_changes_nothing(tiny):
    """Joining twice, joining an empty cache, leaving a stranger, or a step with the wrong number of tokens:
    ValueError, the batch as it was."""
    live = _prefilled(tiny, 0)
    batch = DecodeBatch(tiny)
    batch.join(live)
    width = batch.width
    with pytest.raises(ValueError, match="already"):
        batch.join(live)
    with pytest.raises(ValueError, match="empty"):
        batch.join(LiveCache(tiny))
    with pytest.raises(ValueError, match="not in the batch"):
        batch.leave(_prefilled(tiny, 1))
    with pytest.raises(ValueError, match="rows"):
        batch.step([1, 2], [3, 4])
    assert len(batch) == 1 and batch.width == width
