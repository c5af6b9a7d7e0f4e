"""plan_turn / plan_replace on synthetic layouts, without a model: a plan is data (splices, computed spans,
vision-output slices, store writes, where each image came from), and it tiles the prompt."""

from __future__ import annotations

import pytest
import torch

from mmkv.errors import StoreMismatchError
from mmkv.prompt.layout import SegmentAnchor
from mmkv.runtime import FeatureSlice, Plan, StoreWrite, TurnPolicy, plan_replace, plan_turn
from tests.helpers import (
    END,
    IMAGE_IDS,
    IMAGES,
    PAD,
    START,
    TEXT,
    FakeStores,
    synthetic_layout,
    synthetic_segment,
)


def test_cold_turn_computes_everything_and_stores_each_image_under_kv():
    """Empty live cache, nothing stored: one computed run over the whole prompt, every image's vision outputs
    in order, a store write per image, each image "computed"."""
    layout = synthetic_layout([("text", 3), ("image", 4, 0), ("text", 2), ("image", 4, 1), ("text", 2)])
    plan = plan_turn(layout, IMAGES, 0, TurnPolicy("kv"), FakeStores())
    assert plan.keep == 0 and plan.splices == () and plan.computed == ((0, 19),)
    assert plan.features == (FeatureSlice(0, range(4)), FeatureSlice(1, range(4)))
    assert plan.writes == (StoreWrite(3, 6, "a"), StoreWrite(11, 6, "b"))
    assert [(r.index, r.source) for r in plan.images] == [(0, "computed"), (1, "computed")]
    assert (plan.prefilled, plan.reused) == (19, 0)


@pytest.mark.parametrize("reuse", ["encoder", "none"])
def test_other_policies_never_splice_or_store(reuse):
    """Under encoder/none the store is not asked, nothing is written; the encoder tier is reported."""
    turn_stores = FakeStores(kv={"a": (synthetic_segment(IMAGE_IDS, "a"), "memory")}, encoder={"a": "disk"})
    plan = plan_turn(
        synthetic_layout([("text", 2), ("image", 4, 0), ("text", 2)]),
        IMAGES,
        0,
        TurnPolicy(reuse),
        turn_stores,
    )
    assert turn_stores.asked == [] and plan.splices == () and plan.writes == ()
    assert (plan.images[0].source, plan.images[0].encoder) == (
        "computed",
        "disk",
    )  # KV computed, features cached
    assert plan.images[0].reused_from == "disk" and plan.computed == ((0, 10),)


def test_a_full_live_prefix_computes_only_the_last_token():
    """Everything but the last token live: the images are "live", one token computed, nothing looked up."""
    layout = synthetic_layout([("text", 3), ("image", 4, 0), ("text", 4)])
    turn_stores = FakeStores()
    plan = plan_turn(layout, IMAGES, layout.num_tokens - 1, TurnPolicy("kv"), turn_stores)
    assert plan.computed == ((12, 1),) and plan.splices == () and plan.features == ()
    assert [(r.index, r.source) for r in plan.images] == [(0, "live")] and turn_stores.asked == []


@pytest.mark.parametrize("seam", [0, 1, 3])
def test_a_store_hit_at_another_position_splices_after_its_seam(seam):
    """An image hit in the store, landing after a kept prefix: its first ``seam`` tokens are computed (the start
    marker, then seam - 1 pads from its vision outputs), the rest spliced from the stored segment."""
    stored = synthetic_segment(IMAGE_IDS, "b")
    layout = synthetic_layout([("text", 5), ("image", 4, 1), ("text", 3)])
    plan = plan_turn(layout, IMAGES, 5, TurnPolicy("kv", seam=seam), FakeStores(kv={"b": (stored, "disk")}))
    assert plan.images[0].source == "disk" and plan.writes == ()
    assert plan.images[0].encoder == ("computed" if seam > 1 else None)  # seam pads need vision outputs
    (splice,) = plan.splices
    assert splice.start == 5 + seam and torch.equal(splice.segment.token_ids, stored.token_ids[seam:])
    head = ((5, seam),) if seam else ()
    assert plan.computed == ((*head, (11, 3)) if seam else ((11, 3),))
    assert plan.features == ((FeatureSlice(1, range(seam - 1)),) if seam > 1 else ())


def test_a_stored_segment_for_other_tokens_is_refused():
    """A stored segment whose ids are not the image's span raises StoreMismatchError (never spliced)."""
    layout = synthetic_layout([("text", 2), ("image", 4, 0), ("text", 2)])
    wrong = synthetic_segment([START, PAD, PAD, END], "a")
    with pytest.raises(StoreMismatchError, match="other tokens"):
        plan_turn(layout, IMAGES, 0, TurnPolicy("kv"), FakeStores(kv={"a": (wrong, "memory")}))


def test_window_slide_splices_moved_images_and_cut_off_text():
    """A window slide: the first image left, so everything after the system text moved. The kept image comes
    from the store, the text that followed it from the cut-off live text, and only new text is computed."""
    # prompt: system text (3) | image b (6) | "click" text that was cut off the live cache (4) | new text (3)
    layout = synthetic_layout([("text", 3), ("image", 4, 1), ("text", 7)])
    cut_text = synthetic_segment([TEXT] * 4)
    turn_stores = FakeStores(kv={"b": (synthetic_segment(IMAGE_IDS, "b"), "memory")})
    plan = plan_turn(layout, IMAGES, 3, TurnPolicy("kv", seam=0), turn_stores, reusable_text=[cut_text])
    assert [(s.start, s.end) for s in plan.splices] == [(3, 9), (9, 13)]
    assert plan.computed == ((13, 3),) and plan.reused == 13
    assert plan.images[0].source == "memory"


def test_the_last_token_is_computed_even_when_cached_text_covers_it():
    """Cut-off text matching the whole tail: spliced except its last token, which is computed."""
    layout = synthetic_layout([("text", 6)])
    plan = plan_turn(
        layout, IMAGES, 2, TurnPolicy("kv"), FakeStores(), reusable_text=[synthetic_segment([TEXT] * 4)]
    )
    assert [(s.start, s.end) for s in plan.splices] == [(2, 5)] and plan.computed == ((5, 1),)


@pytest.mark.parametrize("seam", [0, 1, 4])
def test_a_precompiled_segment_splices_after_its_seam(seam):
    """A precompiled text segment the layout places inside a text run: preceding text computed, its first
    ``seam`` tokens computed, the rest spliced; the run's remaining text computed."""
    skill = synthetic_segment([TEXT] * 6)
    layout = synthetic_layout([("text", 12)], segments=(SegmentAnchor(3, skill, seam),))
    plan = plan_turn(layout, IMAGES, 0, TurnPolicy("kv"), FakeStores())
    assert [(s.start, s.end) for s in plan.splices] == [(3 + seam, 9)]
    assert plan.computed == ((0, 3 + seam), (9, 3))
    # under another policy the anchor is ignored
    assert plan_turn(layout, IMAGES, 0, TurnPolicy("encoder"), FakeStores()).computed == ((0, 12),)


def test_a_field_edit_replan_keeps_the_prefix_and_splices_the_moved_tail():
    """plan_replace for a value that grew by one token: [begin, new_end) computed, the old tail spliced (moved),
    selected extra tokens computed in between; image pads among them take their vision-output rows."""
    layout = synthetic_layout(
        [("text", 4), ("text", 3), ("image", 4, 2), ("text", 3)]
    )  # field value at [4, 7)
    old_tail = synthetic_segment(
        [TEXT] * 0 + IMAGE_IDS + [TEXT] * 3
    )  # the old entries after the value (9 tokens)
    plan = plan_replace(layout, 4, 6, 7, old_tail, extra=[9, 14])
    assert plan.keep == 4 and not plan.logits_at_end
    assert plan.computed == ((4, 3), (9, 1), (14, 1))
    assert [(s.start, s.end) for s in plan.splices] == [(7, 9), (10, 14), (15, 16)]
    assert plan.features == (FeatureSlice(2, range(1, 2)),)  # prompt 9 is the image's second pad
    with pytest.raises(ValueError, match="outside"):
        plan_replace(layout, 4, 6, 7, old_tail, extra=[3])


def test_a_plan_must_tile_the_prompt():
    """Gaps, overlaps, a short cover and a spliced last token are refused on construction."""
    with pytest.raises(ValueError, match="tile"):
        Plan(10, 2, (), ((3, 7),), ())
    with pytest.raises(ValueError, match="covers 9 of 10"):
        Plan(10, 2, (), ((2, 7),), ())
    with pytest.raises(ValueError, match="last token"):
        from mmkv.runtime import Splice

        Plan(10, 0, (Splice(8, synthetic_segment([TEXT, TEXT])),), ((0, 8),), ())


def test_placed_segments_are_recorded_with_their_seams():
    """``Plan.placed`` lists every cached segment put at new positions, seam included: a store-hit image, a
    precompiled text, cut-off live text; computed images and plain text are not placed; another policy places
    nothing."""
    skill = synthetic_segment([TEXT] * 5)
    layout = synthetic_layout(
        [("text", 10), ("image", 4, 0), ("image", 4, 1), ("text", 6)], segments=(SegmentAnchor(4, skill, 2),)
    )
    turn_stores = FakeStores(kv={"a": (synthetic_segment(IMAGE_IDS, "a"), "memory")})  # image 1 ("b") misses
    plan = plan_turn(
        layout, IMAGES, 1, TurnPolicy("kv"), turn_stores, reusable_text=[synthetic_segment([TEXT] * 2)]
    )
    # [0] kept | [1, 3) cut-off text | [3, 4) text | [4, 9) skill (seam 2) | [9, 10) text | image a [10, 16) |
    # image b [16, 22) computed | [22, 28) text
    assert plan.placed == ((1, 2), (4, 5), (10, 6))
    assert plan.computed == ((3, 3), (9, 2), (16, 12))
    assert plan_turn(layout, IMAGES, 1, TurnPolicy("encoder"), FakeStores()).placed == ()
    with pytest.raises(ValueError, match="placed"):
        Plan(10, 2, (), ((2, 8),), (), placed=((1, 3),))
