"""LiveCache on each tiny family: the matching prefix (first difference, never half an image, never an image
with other content), truncation that hands back the cut text exactly, prefix copies that share without
changing the original, in-place reordering, batch-row padding, and the error guard."""

from __future__ import annotations

import pytest
import torch

import mmkv
from mmkv.runtime import LiveCache
from tests.conftest import random_image
from tests.helpers import held_prompt


def _session(handle: mmkv.ModelHandle, seeds=(1, 2)) -> mmkv.Session:
    session = mmkv.Session(handle, reuse="none")
    session.add_text("Look at these.")
    for index, seed in enumerate(seeds):
        session.add_image(random_image(seed, (4, 4), handle.processor.patch_size))
        session.add_text(f"That was picture {index}.")
    return session


def _keys(live: LiveCache) -> list[torch.Tensor]:
    return [layer.keys.clone() for layer in live.cache.layers]


def test_matching_prefix_is_the_first_difference_never_half_an_image_never_another_image(tiny):
    """Against the prompt it holds: all but the last token. Another question: the common prefix of ids and
    positions. The same grid with other pixels (equal ids and positions): the image's first token."""
    session = _session(tiny)
    layout, live, _, _ = held_prompt(tiny, session, "Which is brighter?")
    assert live.holds(layout) and live.matching_prefix(layout) == layout.num_tokens - 1

    other = session.prompt_layout("Name the colours, please.")
    n = min(other.num_tokens, layout.num_tokens)
    same = (other.token_ids[:n] == layout.token_ids[:n]) & (
        other.positions[:, :n] == layout.positions[:, :n]
    ).all(0)
    assert live.matching_prefix(other) == int((~same).nonzero()[0])

    swapped = _session(tiny, seeds=(1, 3))  # the second picture differs, its ids and positions do not
    moved = swapped.prompt_layout("Which is brighter?")
    second = [p for p in moved.pieces if p.kind == "image"][1]
    assert torch.equal(moved.token_ids, layout.token_ids) and torch.equal(moved.positions, layout.positions)
    assert live.matching_prefix(moved) == second.begin and not live.holds(moved)


def test_truncate_hands_back_the_cut_text_as_it_was_and_refuses_a_bad_keep(tiny):
    """``truncate(k, collect_text=True)``: the cache and its bookkeeping end at ``k``; each text piece cut off
    whole comes back with exactly the keys and values it had. A ``keep`` out of range raises and changes
    nothing."""
    layout, live, _, _ = held_prompt(tiny, _session(tiny), "Which is brighter?")
    images = [p for p in layout.pieces if p.kind == "image"]
    keep = images[0].end  # the first image kept, the second and all text after it cut
    cut = [p for p in layout.pieces if p.kind == "text" and p.begin >= keep]
    before = [live.segment(p.begin, p.end) for p in cut]
    for bad in (-1, live.num_tokens + 1):
        with pytest.raises(ValueError, match="cannot keep"):
            live.truncate(bad)
    assert live.num_tokens == layout.num_tokens
    segments = live.truncate(keep, collect_text=True)
    assert live.num_tokens == keep == live.cache.get_seq_length() and len(segments) == len(cut)
    assert set(live.image_digests) == {images[0].begin}
    for got, want in zip(segments, before, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.position_ids, want.position_ids)


def test_a_prefix_copy_shares_the_entries_and_growing_it_leaves_the_original_as_it_was(tiny):
    layout, live, _, _ = held_prompt(tiny, _session(tiny), "Which is brighter?")
    keep = layout.num_tokens - 5
    original = _keys(live)
    copy = live.copy_prefix(keep)
    assert copy.num_tokens == keep and torch.equal(copy.segment().keys, live.segment(0, keep).keys)
    with torch.inference_mode():
        copy.extend(layout.token_ids[keep : keep + 3], layout.positions[:, keep : keep + 3])
    assert copy.num_tokens == keep + 3 and live.num_tokens == layout.num_tokens
    assert all(torch.equal(a, b.keys) for a, b in zip(original, live.cache.layers, strict=True))
    for bad in (0, live.num_tokens + 1):
        with pytest.raises(ValueError, match="cannot copy"):
            live.copy_prefix(bad)


def test_reorder_tail_permutes_exactly_the_entries_after_keep(tiny):
    """Entry ``keep + i`` becomes the old entry ``keep + order[i]`` in every layer; the first ``keep`` stay."""
    _, live, _, _ = held_prompt(tiny, _session(tiny, seeds=(4,)), "Why?")
    keep, tail = 3, live.num_tokens - 3
    order = torch.randperm(tail, generator=torch.Generator().manual_seed(0))
    before = _keys(live)
    with torch.inference_mode():  # (as execute runs it: the cache's tensors are inference tensors)
        live.reorder_tail(keep, order)
    for old, layer in zip(before, live.cache.layers, strict=True):
        assert torch.equal(layer.keys[:, :, :keep], old[:, :, :keep])
        assert torch.equal(layer.keys[:, :, keep:], old[:, :, keep:][:, :, order])


def test_padded_layers_put_zeros_first_and_take_decoded_checks_what_it_is_given(tiny):
    _, live, _, _ = held_prompt(tiny, _session(tiny, seeds=(5,)), "Why?")
    n = live.num_tokens
    padded = live.padded_layers(n + 3)
    for (keys, values), layer in zip(padded, live.cache.layers, strict=True):
        assert keys.shape[2] == n + 3 and not keys[:, :, :3].any() and not values[:, :, :3].any()
        assert torch.equal(keys[:, :, 3:], layer.keys) and torch.equal(values[:, :, 3:], layer.values)
    with pytest.raises(ValueError, match="cannot lay"):
        live.padded_layers(n - 1)
    wrong = [(k[:, :, 3:], v[:, :, 3:]) for k, v in padded]  # n entries for n held + 1 decoded
    with pytest.raises(ValueError, match="entries given"):
        live.take_decoded(wrong, torch.tensor([7]), torch.full((3, 1), live.next_position))
    with pytest.raises(ValueError, match="layers given"):
        live.take_decoded(wrong[:-1], torch.tensor([7]), torch.full((3, 1), live.next_position))
    assert live.num_tokens == n


def test_an_error_inside_the_guard_empties_the_cache_and_propagates(tiny):
    _, live, _, _ = held_prompt(tiny, _session(tiny, seeds=(6,)), "Why?")
    with pytest.raises(RuntimeError, match="boom"), live.dropped_on_error():
        raise RuntimeError("boom")
    assert (
        live.num_tokens == 0 == live.cache.get_seq_length() and live.pieces == () and live.image_digests == {}
    )
