"""The token rankings (``mmkv.runtime.ranking``): the first-layer recompute equals the model's own layers, the
scores equal their definitions computed by hand, ``top_k``'s order and ties, and the repair and the field edit
scoring through this module only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmkv.kv.prefill import prefill_span
from mmkv.mrope.positions import text_positions
from mmkv.runtime import LiveCache
from mmkv.runtime.ranking import (
    DEVIATION_LAYERS,
    deviation_depth,
    kv_deviation,
    received_attention,
    recompute_first_layers,
    top_k,
)

ROOT = Path(__file__).resolve().parents[2]


def _text_ids(handle, n: int, seed: int) -> torch.Tensor:
    """``n`` ordinary token ids (no control token), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 200, (n,), generator=generator)


# ------------------------------------------------------------------------------ the first-layer recompute
def test_the_first_layers_alone_give_the_models_own_keys(tiny):
    """Without context, the recomputed layer's keys and values are bit for bit those of a full prefill (all
    layers) of the same tokens: the shallow variant runs the same first layers."""
    ids, positions = _text_ids(tiny, 24, 1), text_positions(0, 24)
    full = prefill_span(tiny, ids, positions).cache.layers[deviation_depth(tiny) - 1]
    keys, values = recompute_first_layers(tiny, None, ids, positions)
    assert keys.shape == full.keys[0].shape == (tiny.kv_shape[1], 24, tiny.kv_shape[2])
    assert torch.equal(keys, full.keys[0]) and torch.equal(values, full.values[0])


@pytest.mark.parametrize("split", [1, 9, 23])
def test_the_first_layers_after_a_scratch_prefix_match_one_prefill(tiny, split):
    """After a scratch copy of a live prefix (``LiveCache.layer_prefix``), the recomputed span's KV matches a full
    prefill of the whole prompt (float tolerance: the chunking differs); the live cache is unchanged."""
    ids, positions = _text_ids(tiny, 24, 2), text_positions(0, 24)
    full = prefill_span(tiny, ids, positions).cache.layers[deviation_depth(tiny) - 1]
    live = LiveCache(tiny)
    live.forward(ids[:split], positions[:, :split])
    before = [layer.keys.clone() for layer in live.cache.layers]
    scratch = live.layer_prefix(split, deviation_depth(tiny))
    keys, values = recompute_first_layers(tiny, scratch, ids[split:], positions[:, split:])
    assert keys.shape[1] == 24
    torch.testing.assert_close(keys, full.keys[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, full.values[0], atol=1e-5, rtol=1e-5)
    assert all(layer.keys.shape[2] == split for layer in live.cache.layers)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, live.cache.layers, strict=True))


def test_the_depth_is_bounded_by_the_model(tiny):
    """Two layers, or every layer of a shallower model."""
    assert deviation_depth(tiny) == min(DEVIATION_LAYERS, tiny.num_layers)


# ------------------------------------------------------------------------------------------ the scores
@pytest.mark.parametrize(("heads", "tokens", "dim"), [(1, 1, 4), (2, 7, 8), (4, 3, 16)])
def test_kv_deviation_is_the_sum_of_the_two_norms(heads, tokens, dim):
    """Per token: ||fresh K - cached K|| + ||fresh V - cached V||, each over heads and channels (by hand)."""
    generator = torch.Generator().manual_seed(heads * 100 + tokens)
    fk, fv, ck, cv = (torch.randn(heads, tokens, dim, generator=generator) for _ in range(4))
    scores = kv_deviation(fk, fv, ck, cv)
    by_hand = [
        float(((fk[:, t] - ck[:, t]) ** 2).sum().sqrt() + ((fv[:, t] - cv[:, t]) ** 2).sum().sqrt())
        for t in range(tokens)
    ]
    assert scores.shape == (tokens,) and scores.device.type == "cpu"
    assert scores.tolist() == pytest.approx(by_hand, rel=1e-5)
    assert kv_deviation(fk, fv, fk, fv).abs().max() == 0
    assert torch.allclose(kv_deviation(ck + 2 * (fk - ck), cv + 2 * (fv - cv), ck, cv), 2 * scores, rtol=1e-5)


@pytest.mark.parametrize(("layers", "heads", "queries", "keys"), [(1, 1, 1, 5), (3, 2, 4, 9), (2, 4, 1, 6)])
def test_received_attention_averages_layers_heads_and_queries(layers, heads, queries, keys):
    """The mean over every (layer, head, query) of the weight given to each key (by hand)."""
    generator = torch.Generator().manual_seed(layers * 10 + queries)
    weights = [torch.rand(1, heads, queries, keys, generator=generator).softmax(-1) for _ in range(layers)]
    got = received_attention(weights)
    by_hand = [
        sum(float(w[0, h, q, k]) for w in weights for h in range(heads) for q in range(queries))
        / (layers * heads * queries)
        for k in range(keys)
    ]
    assert got.shape == (keys,) and got.tolist() == pytest.approx(by_hand, rel=1e-5)


# -------------------------------------------------------------------------------------------- top_k
def test_top_k_takes_the_highest_ties_to_the_earlier():
    assert top_k(torch.tensor([1.0, 3.0, 0.5, 3.0]), 2) == [1, 3]
    assert top_k(torch.tensor([2.0, 2.0, 2.0]), 2) == [0, 1]
    assert top_k(torch.tensor([0.1, float("-inf"), 0.2]), 5) == [0, 1, 2]  # k beyond n: all
    assert top_k(torch.tensor([0.1, 0.2]), 0) == [] and top_k(torch.tensor([]), 3) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), max_size=30), st.integers(0, 35))
def test_top_k_is_a_stable_selection(values, k):
    """Ascending, ``min(k, n)`` indices; every chosen score >= every other; among equal scores at the cut, the
    earlier indices are the chosen ones."""
    scores = torch.tensor(values, dtype=torch.float32)
    chosen = top_k(scores, k)
    rest = [i for i in range(len(values)) if i not in chosen]
    assert chosen == sorted(set(chosen)) and len(chosen) == min(k, len(values))
    if chosen and rest:
        cut = min(values[i] for i in chosen)
        assert all(values[i] <= cut for i in rest)
        assert all(i > max(j for j in chosen if values[j] == cut) for i in rest if values[i] == cut)


# ---------------------------------------------------------------------------------------- one module
@pytest.mark.parametrize("path", ["mmkv/runtime/repair.py", "mmkv/text/edit.py"])
def test_the_repair_and_the_edit_score_through_the_ranking_module(path):
    """Neither computes a norm, a top-k or a sort of its own, and both import the ranking module."""
    source = (ROOT / path).read_text()
    assert not re.search(r"\.norm\(|topk\(|torch\.sort\(|DEVIATION_LAYERS|min\(2,", source)
    assert "ranking import" in source
