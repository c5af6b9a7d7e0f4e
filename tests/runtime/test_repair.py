"""The repair beyond the seam (``TurnPolicy.repair`` / ``budget``, ``mmkv.runtime.repair``): the plan it makes
(pure), its exactness in the same context, the budget's exact count, the default left unchanged (the policy's
own checks: tests/test_policy.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.prompt.layout import SegmentAnchor
from mmkv.runtime import FeatureSlice, LiveCache, TurnPolicy, TurnStores, plan_turn
from mmkv.runtime.ranking import PROBE_TOKENS
from mmkv.runtime.repair import choose, recompute_within, repair_plan, repair_stats
from tests.conftest import random_image
from tests.helpers import (
    IMAGE_IDS,
    IMAGES,
    TEXT,
    FakeStores,
    full_forward_logits,
    synthetic_layout,
    synthetic_segment,
)

HISTORY = "Here is a long history of earlier steps in the task, unrelated to the picture. " * 3


# ------------------------------------------------------------------------------------ plans, without a model
def test_recompute_within_splits_the_splices_and_redraws_the_vision_rows():
    """Chosen spliced indices become computed: the splice around them is split (the pieces keep their tokens),
    computed runs merge with neighbours, computed pads take their vision-output rows; the plan still tiles."""
    stored = synthetic_segment(IMAGE_IDS, "b")  # [START, PAD x 4, END]
    layout = synthetic_layout([("text", 5), ("image", 4, 1), ("text", 3)])  # image at [5, 11)
    plan = plan_turn(layout, IMAGES, 5, TurnPolicy("kv", seam=1), FakeStores(kv={"b": (stored, "disk")}))
    assert [(s.start, s.end) for s in plan.splices] == [(6, 11)]
    repaired = recompute_within(plan, layout, [6, 8, 10])
    assert [(s.start, s.end) for s in repaired.splices] == [(7, 8), (9, 10)]
    assert repaired.computed == ((5, 2), (8, 1), (10, 4))
    assert repaired.features == (
        FeatureSlice(1, (0, 2)),
    )  # pads 0 and 2 (prompt 6 and 8); 10 is the end marker
    assert torch.equal(repaired.splices[1].segment.token_ids, stored.token_ids[4:5])
    assert (repaired.prefilled, repaired.reused) == (plan.prefilled + 3, plan.reused - 3)
    with pytest.raises(ValueError, match="not spliced"):
        recompute_within(plan, layout, [5])  # the seam: computed already


def test_choose_takes_the_top_scores_per_segment_or_the_leading_tokens():
    """Per group: the ``count`` highest scores (ties to the earlier token), or the first ``count`` without
    scores; groups with count 0 give nothing; the result is ascending."""
    groups = [torch.tensor([2, 3, 4]), torch.tensor([7, 8, 9, 10])]
    scores = torch.tensor([0, 0, 5.0, 1.0, 5.0, 0, 0, 0.1, 0.3, 0.2, 0.9])
    assert choose(groups, [1, 2], scores) == [2, 8, 10]
    assert choose(groups, [2, 0], None) == [2, 3]
    assert choose(groups, [0, 0], scores) == []


def test_repair_stats_count_what_each_placed_segment_recomputes():
    """Placed tokens, those computed in context (seams and choice), and the spliced images' share of both."""
    skill = synthetic_segment([TEXT] * 6)
    layout = synthetic_layout(
        [("text", 10), ("image", 4, 0), ("text", 2)], segments=(SegmentAnchor(2, skill, 2),)
    )
    plan = plan_turn(
        layout,
        IMAGES,
        0,
        TurnPolicy("kv", seam=1),
        FakeStores(kv={"a": (synthetic_segment(IMAGE_IDS), "memory")}),
    )
    stats = repair_stats(recompute_within(plan, layout, [5, 12]), layout, chosen=2)
    assert (stats.placed, stats.recomputed, stats.chosen) == (12, 5, 2)  # skill 2 + 1, image 1 + 1
    assert (stats.image_tokens, stats.image_recomputed) == (6, 2) and stats.image_fraction == pytest.approx(
        1 / 3
    )
    assert repair_stats(plan_turn(layout, IMAGES, 0, TurnPolicy("none"), FakeStores()), layout).placed == 0


# ------------------------------------------------------------------------------------------ with a model
def _image(handle, seed=10, grid=(4, 6)):
    return random_image(seed, grid, handle.processor.patch_size)


def _warm(handle, images, preamble=""):
    """Stores (KV and vision outputs) warmed by a session that showed ``images`` after ``preamble``."""
    store, encoder_store = KVStore(), EncoderStore()
    warm = mmkv.Session(handle, store=store, encoder_store=encoder_store)
    if preamble:
        warm.add_text(preamble)
    for image in images:
        warm.add_image(image)
    warm.next_token_logits("Describe it.")
    return store, encoder_store


def _session(handle, stores, images, preamble="", **settings):
    session = mmkv.Session(
        handle, store=stores[0], encoder_store=stores[1], config=mmkv.SessionConfig.of(**settings)
    )
    if preamble:
        session.add_text(preamble)
    for image in images:
        session.add_image(image)
    return session


@pytest.mark.parametrize("repair", ["seam", "deviation", "attention"])
def test_a_repair_in_the_same_context_is_exact_and_honours_its_budget(tiny, repair):
    """Spliced where it was cached, any choice is exact: logits equal full recompute (<= 1e-4); the turn computes
    exactly ceil(budget x spliced) more tokens per image than the seam alone, and says so."""
    images = [_image(tiny, 10), _image(tiny, 11, (6, 2))]
    stores = _warm(tiny, images)
    plain = _session(tiny, stores, images)
    plain.next_token_logits("Describe it.")
    session = _session(tiny, stores, images, repair=repair, budget=0.3)
    logits = session.next_token_logits("Describe it.")
    assert (logits - full_forward_logits(tiny, session, "Describe it.")).abs().max().item() <= 1e-4
    stats, base = session.last_prefill, plain.last_prefill
    lengths = [
        piece.length for piece in session.prompt_layout("Describe it.").pieces if piece.kind == "image"
    ]
    chosen = sum(math.ceil(0.3 * (n - 1)) for n in lengths)  # seam 1: n - 1 spliced per image
    assert stats.repair.chosen == chosen and stats.prefilled == base.prefilled + chosen
    assert (
        stats.repair.image_tokens == sum(lengths) and stats.repair.image_recomputed == len(lengths) + chosen
    )
    assert [r.source for r in stats.images] == ["memory", "memory"]
    assert stats.repair.pass_layers == {"seam": 0, "deviation": 2, "attention": tiny.num_layers}[repair]


@pytest.mark.parametrize("repair", ["deviation", "attention"])
def test_a_whole_budget_in_another_context_equals_full_recompute(tiny, repair):
    """budget 1: every spliced token is recomputed in the new context, so even a moved image gives the logits of
    full recompute (<= 1e-4), while the seam alone does not."""
    image = _image(tiny)
    stores = _warm(tiny, [image])
    whole = _session(tiny, stores, [image], HISTORY, repair=repair, budget=1.0)
    reference = full_forward_logits(tiny, whole, "Describe it.")
    assert (whole.next_token_logits("Describe it.") - reference).abs().max().item() <= 1e-4
    assert whole.last_prefill.prefilled == whole.last_prefill.prompt_tokens
    seam = _session(tiny, stores, [image], HISTORY).next_token_logits("Describe it.")
    assert (seam - reference).abs().max().item() > 1e-3


def test_the_default_policy_is_the_plain_seam_bit_for_bit(tiny):
    """repair "seam" with no budget (the default), and any repair with budget 0, leave the plan as it was (the
    same object) and the logits of a moved image identical to the seam's."""
    image = _image(tiny)
    stores = _warm(tiny, [image])
    default = _session(tiny, stores, [image], HISTORY).next_token_logits("Describe it.")
    for repair in ("seam", "deviation", "attention"):
        zero = _session(tiny, stores, [image], HISTORY, repair=repair, budget=0.0)
        assert torch.equal(zero.next_token_logits("Describe it."), default)
        assert zero.last_prefill.repair.chosen == 0 and zero.last_prefill.repair.seconds == 0.0
        layout = zero.prompt_layout("Describe it.")
        turn_stores = TurnStores(tiny, stores[0], stores[1], TurnPolicy())
        plan = plan_turn(layout, zero.images, 0, zero.config.policy, turn_stores)
        assert repair_plan(tiny, LiveCache(tiny), plan, layout, zero.images, turn_stores)[0] is plan


def test_deviation_picks_the_token_whose_stored_kv_was_corrupted(tiny):
    """A stored image whose layer-1 K/V of one pad is off: with a budget of one token, the deviation ranking
    recomputes exactly that pad (the others deviate by rounding only: same context)."""
    image = _image(tiny)
    store, encoder_store = _warm(tiny, [image])
    session = _session(tiny, (store, encoder_store), [image])
    digest = session.images[0].digest
    stored = store.get(digest, tiny)
    target = 4  # the segment's fifth token: a pad
    keys, values = stored.keys.clone(), stored.values.clone()
    keys[1, :, :, target] += 3.0
    values[1, :, :, target] -= 3.0
    store.put(digest, replace(stored, keys=keys, values=values), tiny)
    layout = session.prompt_layout("Describe it.")
    turn_stores = TurnStores(tiny, store, encoder_store, TurnPolicy())
    policy = TurnPolicy(repair="deviation", budget=1 / (stored.length - 1))
    plan = plan_turn(layout, session.images, 0, policy, turn_stores)
    repaired, stats = repair_plan(tiny, LiveCache(tiny), plan, layout, session.images, turn_stores)
    start = next(p.begin for p in layout.pieces if p.kind == "image")
    assert stats.chosen == 1 and (start + target, 1) in repaired.computed
    assert repaired.images[0].encoder == "memory"  # the pass read the vision outputs from the encoder store


def test_a_repair_after_a_live_prefix_leaves_the_live_cache_alone(tiny):
    """Turn 2 keeps turn 1's live prefix and splices a moved image: both rankings read the live cache only (its
    K/V are bit-identical afterwards) and choose within the spliced tokens."""
    first, second = _image(tiny, 10), _image(tiny, 11, (6, 2))
    stores = _warm(tiny, [second], preamble=HISTORY)
    for repair in ("deviation", "attention"):
        session = _session(tiny, stores, [first], repair=repair, budget=0.5)
        session.ask("Describe it.", max_new_tokens=1)
        session.add_image(second)
        layout = session.prompt_layout("And this one?")
        live = session.live
        keep = live.matching_prefix(layout)
        live.truncate(keep)
        before = live.segment()
        turn_stores = TurnStores(tiny, stores[0], stores[1], TurnPolicy())
        plan = plan_turn(layout, session.images, keep, session.config.policy, turn_stores)
        repaired, stats = repair_plan(tiny, live, plan, layout, session.images, turn_stores)
        after = live.segment()
        assert torch.equal(before.keys, after.keys) and torch.equal(before.values, after.values)
        assert keep > 0 and stats.chosen == math.ceil(0.5 * plan.splices[0].segment.length)
        assert repaired.prefilled == plan.prefilled + stats.chosen
        assert stats.pass_tokens == (plan.splices[-1].end - keep if repair == "deviation" else
                                     min(PROBE_TOKENS, layout.num_tokens - plan.splices[-1].end))  # fmt: skip


def test_a_precompiled_segment_is_repaired_like_an_image(tiny):
    """A precompiled text spliced after other text: its budget is taken of its own spliced tokens, and a whole
    budget makes it exact."""
    segment = mmkv.text.precompile(tiny, "Policy: approve red badges, escalate the rest. " * 2)
    counts = {}
    for budget in (0.2, 1.0):
        session = mmkv.Session(tiny, config=mmkv.SessionConfig.of(repair="deviation", budget=budget))
        session.add_text(HISTORY)
        session.add_segment(segment, seam=1)
        logits = session.next_token_logits("What now?")
        counts[budget] = session.last_prefill.repair
        if budget == 1.0:
            reference = session.fork(reuse="none").next_token_logits("What now?")
            assert (logits - reference).abs().max().item() <= 1e-4
    assert counts[0.2].placed == segment.length and counts[0.2].image_tokens == 0
    assert counts[0.2].chosen == math.ceil(0.2 * (segment.length - 1))
    assert counts[1.0].recomputed == segment.length
