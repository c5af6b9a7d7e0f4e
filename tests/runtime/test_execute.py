"""execute and its parts: the attention mask a splice needs, vision-output slices, splices placed at their
prompt positions (re-rotated or only relabelled), a plan that does not fit the cache refused unchanged, and an
edited span recomputed in context equal to a cold prefill of the edited prompt."""

from __future__ import annotations

import pytest
import torch

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.runtime import (
    FeatureSlice,
    Splice,
    TurnPolicy,
    TurnStores,
    attention_mask,
    replace_span,
    resolve_features,
)
from mmkv.runtime.execute import execute_steps, place_splices
from mmkv.runtime.plan import plan_turn
from tests.conftest import random_image
from tests.helpers import held_prompt

NONE = TurnPolicy(reuse="none")


@pytest.mark.parametrize("seed", range(5))
def test_the_mask_lets_a_query_see_exactly_the_entries_at_or_before_it(seed):
    """On random cache orders: bool True where ``entry <= query`` (sdpa), the additive float mask 0 there and
    the dtype's min elsewhere (eager); shape ``(1, 1, Q, K)``."""
    g = torch.Generator().manual_seed(seed)
    entries = torch.randperm(12, generator=g)
    queries = torch.randint(0, 12, (5,), generator=g)
    allowed = torch.tensor([[int(e) <= int(q) for e in entries] for q in queries])
    boolean = attention_mask(entries, queries, torch.bool)
    assert boolean.shape == (1, 1, 5, 12) and torch.equal(boolean[0, 0], allowed)
    for dtype in (torch.float32, torch.bfloat16):
        additive = attention_mask(entries, queries, dtype)[0, 0]
        assert additive.dtype == dtype and torch.equal(additive == 0, allowed)
        assert bool((additive[~allowed] == torch.finfo(dtype).min).all())


def _one_image(handle: mmkv.ModelHandle, seed: int = 1) -> mmkv.Session:
    session = mmkv.Session(handle, reuse="none")
    session.add_image(random_image(seed, (4, 6), handle.processor.patch_size))
    return session


def test_vision_output_slices_are_the_rows_they_name(tiny):
    """The whole range is the image's own outputs (the same object); a contiguous range and a set of rows are
    those rows of the embeddings and of every DeepStack level, in the order named."""
    session = _one_image(tiny)
    images = session.conversation.images
    turn = TurnStores(tiny, KVStore(), EncoderStore(), NONE)
    with torch.inference_mode():
        full = turn.features(images[0])[0]
        whole, run, rows = resolve_features(
            [FeatureSlice(0, range(full.num_pads)), FeatureSlice(0, range(2, 5)), FeatureSlice(0, (5, 0, 3))],
            images, turn,
        )  # fmt: skip
    assert whole is full
    for got, index in ((run, [2, 3, 4]), (rows, [5, 0, 3])):
        assert torch.equal(got.embeds, full.embeds[index]) and got.num_pads == len(index)
        assert len(got.deepstack) == len(full.deepstack)
        assert all(torch.equal(a, b[index]) for a, b in zip(got.deepstack, full.deepstack, strict=True))


def test_a_splice_placed_where_it_was_computed_is_unchanged_and_moved_there_and_back_recovers_it(tiny):
    """``place_splices``: at its own positions the keys are bit for bit the cached ones; the no-rotation control
    only relabels positions; moved by +d then by -d the keys come back to float32 rounding, and moved they
    differ (the rotation is applied)."""
    _, live, _, _ = held_prompt(tiny, _one_image(tiny), "What is it?")
    segment = live.segment(2, 12)
    here = place_splices([Splice(2, segment)], live.positions, TurnPolicy(reuse="kv"))
    assert torch.equal(here.keys, segment.keys) and torch.equal(here.position_ids, segment.position_ids)
    moved_positions = torch.cat(
        [live.positions, live.positions + 40], dim=1
    )  # a prompt where [L+2, L+12) sits 40 on
    start = live.num_tokens + 2
    moved = place_splices([Splice(start, segment)], moved_positions, TurnPolicy(reuse="kv"))
    control = place_splices([Splice(start, segment)], moved_positions, TurnPolicy(reuse="kv", rotate=False))
    assert torch.equal(moved.position_ids, segment.position_ids + 40) and torch.equal(
        control.keys, segment.keys
    )
    assert (moved.keys - segment.keys).abs().max().item() > 1e-3
    back = place_splices([Splice(2, moved)], live.positions, TurnPolicy(reuse="kv"))
    assert (back.keys - segment.keys).abs().max().item() <= 1e-4


def test_a_plan_that_does_not_fit_the_cache_is_refused_and_changes_nothing(tiny):
    session = _one_image(tiny)
    layout, live, _, _ = held_prompt(tiny, session, "What is it?")
    turn = TurnStores(tiny, KVStore(), EncoderStore(), NONE)
    plan = plan_turn(
        layout, session.conversation.images, 0, NONE, turn
    )  # keeps 0; the cache holds the prompt
    before = live.segment()
    with pytest.raises(ValueError, match=rf"holds {layout.num_tokens} entries; the plan keeps 0"):
        next(execute_steps(tiny, live, plan, layout, session.conversation.images, turn))
    assert live.holds(layout) and torch.equal(live.segment().keys, before.keys)
    live.truncate(0)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        next(execute_steps(tiny, live, plan, layout, session.conversation.images, turn, 0))
    assert live.num_tokens == 0 == live.cache.get_seq_length()


def _texts(handle: mmkv.ModelHandle, code: str) -> mmkv.Session:
    session = _one_image(handle, seed=2)
    session.add_text(f"The door code is {code}. Remember it for later, and say nothing yet.")
    session.add_text("Noted.", role="assistant")
    return session


@pytest.mark.parametrize("new_code", ["98765 4321", "7"])  # a longer and a shorter edit
def test_an_edited_span_recomputed_with_everything_after_it_equals_a_cold_prefill(tiny, new_code):
    """``replace_span`` over the changed tokens with every later token as ``extra``: the cache then holds the
    edited prompt with a cold prefill's keys and values (same context, float32 rounding); spans that do not fit
    are refused with the cache unchanged."""
    old_layout, live, _, _ = held_prompt(tiny, _texts(tiny, "1234"), "What is the code?")
    edited = _texts(tiny, new_code)
    layout, _, _, _ = cold = held_prompt(tiny, edited, "What is the code?")
    old_ids, new_ids = old_layout.token_ids.tolist(), layout.token_ids.tolist()
    begin = next(i for i, (a, b) in enumerate(zip(old_ids, new_ids, strict=False)) if a != b)
    same_tail = next(i for i in range(1, len(new_ids)) if old_ids[-i] != new_ids[-i]) - 1
    old_end, new_end = len(old_ids) - same_tail, len(new_ids) - same_tail
    turn = TurnStores(tiny, KVStore(), EncoderStore(), NONE)
    with pytest.raises(ValueError, match="do not match"):
        replace_span(tiny, live, layout, edited.conversation.images, turn, begin, old_end + 1, new_end)
    assert live.holds(old_layout)
    with torch.inference_mode():
        replace_span(tiny, live, layout, edited.conversation.images, turn, begin, old_end, new_end,
                     extra=range(new_end, layout.num_tokens))  # fmt: skip
    assert live.holds(layout)
    reference = cold[1].segment()
    got = live.segment()
    assert (got.keys - reference.keys).abs().max().item() <= 1e-4
    assert (got.values - reference.values).abs().max().item() <= 1e-4
    assert torch.equal(got.position_ids, reference.position_ids)
