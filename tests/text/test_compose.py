"""Precompiled text segments (mmkv.text.compose): exact where compiled, exactly re-rotated when moved, stored
with images, spliced by sessions, and editable once spliced."""

from __future__ import annotations

import torch

import mmkv
from mmkv.cache import KVStore
from mmkv.kv import prefill_span
from mmkv.kv.spans import text_span
from mmkv.text import TextSegment, canonical_preamble, precompile
from tests.conftest import random_image

SKILL = "Skill: to close a dialog, click the button labelled {button}; never press escape twice in a row."
QUESTION = "Which button closes it?"


def test_canonical_preamble_is_what_precedes_a_first_user_message(tiny):
    preamble = canonical_preamble(tiny)
    assert preamble.endswith(("<|im_start|>user\n", "<|user|>\n"))  # Qwen, GLM
    session = mmkv.Session(tiny)
    session.add_text("hello")
    assert tiny.tokenizer.decode(session.render(None)[0]).startswith(preamble + "hello")


def test_spliced_where_compiled_equals_prefilling_in_place(tiny):
    segment = precompile(tiny, SKILL, {"button": "Close"})
    assert isinstance(segment, TextSegment) and segment.text.endswith(
        "labelled Close; never press escape twice in a row."
    )
    spliced = mmkv.Session(tiny, reuse="kv")
    spliced.add_segment(segment, seam=0)
    plain = mmkv.Session(tiny, reuse="none")
    plain.add_text(SKILL, fields={"button": "Close"})
    got, expected = spliced.next_token_logits(QUESTION), plain.next_token_logits(QUESTION)
    assert spliced.last_prefill.prefilled == spliced.last_prefill.prompt_tokens - segment.length  # spliced
    assert (got - expected).abs().max() <= 1e-5
    begin = len(tiny.processor.encode_text(canonical_preamble(tiny)))
    live, reference = spliced.live.segment(), plain.live.segment()
    span = slice(begin, begin + segment.length)
    assert torch.equal(live.token_ids[span], segment.token_ids)
    assert torch.allclose(live.keys[:, :, :, span], reference.keys[:, :, :, span], atol=1e-5)


def test_moved_equals_prefilling_at_the_new_position_after_the_same_preamble(tiny):
    """<= 1e-5 for moves of tens of positions. Further out the reference itself drifts: the model forms its
    rotary angles as fl32(p * f), an error that grows with p (the same at float64 weights, as the angles are
    fp32 regardless); for tiny-qwen3-vl the gap is 1.9e-5 at +250 and 1.3e-4 at +1000, for tiny-qwen2.5-vl
    under 4e-7 throughout."""
    segment = precompile(tiny, SKILL, {"button": "Close"})
    preamble_ids = tiny.processor.encode_text(segment.preamble)
    for shift, bound in ((17, 1e-5), (37, 1e-5), (250, 1e-4)):
        ids, positions = text_span(preamble_ids, shift)
        context = prefill_span(tiny, ids, positions).cache
        ids, positions = text_span(segment.token_ids, shift + len(preamble_ids))
        expected = prefill_span(tiny, ids, positions, context=context).segment
        moved = segment.moved_to(shift + len(preamble_ids))
        assert torch.equal(moved.position_ids, expected.position_ids)
        assert (moved.keys - expected.keys).abs().max() <= bound
        assert (moved.values - expected.values).abs().max() <= bound


def test_precompiled_segments_share_the_image_store(tiny, tmp_path):
    store = KVStore(tmp_path / "kv")
    first = precompile(tiny, SKILL, {"button": "Close"}, store=store)
    assert store.stats().memory.entries == 1 and store.stats().memory.misses == 1
    again = precompile(tiny, SKILL, {"button": "Close"}, store=KVStore(tmp_path / "kv"))  # from disk
    assert torch.equal(again.keys, first.keys) and torch.equal(again.values, first.values)
    assert again.digest == first.digest and again.text == first.text
    other = precompile(tiny, SKILL, {"button": "Cancel"}, store=store)
    assert other.digest != first.digest
    other_preamble = precompile(tiny, SKILL, {"button": "Close"}, preamble="<|im_start|>system\n")
    assert other_preamble.digest != first.digest


def _interleaved(handle, segment, **settings) -> mmkv.Session:
    session = mmkv.Session(handle, **settings)
    session.add_image(random_image(1, (4, 4), handle.processor.patch_size))
    session.add_text("First screen. ")
    if segment is None:
        session.add_text(SKILL, fields={"button": "Close"})
    else:
        session.add_segment(segment, seam=2)
    session.add_image(random_image(2, (4, 6), handle.processor.patch_size))
    return session


def test_a_session_splices_a_segment_between_images_with_a_seam(tiny):
    segment = precompile(tiny, SKILL, {"button": "Close"})
    cached = _interleaved(tiny, segment, reuse="kv")
    reference = _interleaved(tiny, None, reuse="none")
    unrotated = _interleaved(
        tiny, segment, reuse="kv", config=mmkv.SessionConfig.of(reuse="kv", rotate=False)
    )
    assert torch.equal(cached.render(QUESTION)[0], reference.render(QUESTION)[0])
    expected = reference.next_token_logits(QUESTION)
    got = cached.next_token_logits(QUESTION)
    spliced = cached.last_prefill.prompt_tokens - cached.last_prefill.prefilled
    assert spliced == segment.length - 2  # the segment minus its seam; the images were new (computed)
    live = cached.live.segment()
    begin = live.token_ids.tolist().index(int(segment.token_ids[2])) - 2  # where the segment landed
    placed = segment.slice(2).moved_to(int(live.position_ids[0, begin + 2]))
    assert torch.equal(live.keys[:, :, :, begin + 2 : begin + segment.length], placed.keys)
    assert torch.equal(live.values[:, :, :, begin + 2 : begin + segment.length], placed.values)
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0)
    control = torch.nn.functional.cosine_similarity(unrotated.next_token_logits(QUESTION), expected, dim=0)
    assert cosine < 1 and control < 1  # moved into another context: approximate
    # (that rotation matters at a larger move: tests/test_session.py's moved image; over this move of ~20
    # positions GLM-4.1V's 8 rotary frequencies leave the two within 1e-3 of each other)
    assert not torch.equal(unrotated.live.segment().keys, live.keys)


def test_a_field_inside_a_segment_spliced_where_compiled_edited_by_suffix_equals_full_recompute(tiny):
    segment = precompile(tiny, SKILL, {"button": "Close"})
    session = mmkv.Session(tiny, reuse="kv")
    session.add_segment(segment, seam=0)
    session.add_text(" Now the dialog is open.")
    session.prefill()
    assert session.last_prefill.reused == segment.length  # spliced
    report = session.edit("button", "Dismiss", "suffix")
    reference = mmkv.Session(tiny, reuse="none")
    reference.add_text(SKILL, fields={"button": "Dismiss"})
    reference.add_text(" Now the dialog is open.")
    assert torch.equal(session.render(QUESTION)[0], reference.render(QUESTION)[0])
    got, expected = session.next_token_logits(QUESTION), reference.next_token_logits(QUESTION)
    assert (got - expected).abs().max() <= 1e-4
    assert report.recomputed < report.context_tokens


def test_a_field_inside_a_transplanted_segment_edited_by_suffix_is_recomputed_exactly_from_the_field(tiny):
    """Moved into another context, the segment's tokens before the field keep their spliced KV (the splice's
    approximation; the field cannot change them, attention being causal); everything from the field on must
    equal a fresh prefill over that prefix."""
    segment = precompile(tiny, SKILL, {"button": "Close"})
    session = mmkv.Session(tiny, reuse="kv")
    session.add_text("You operate a desktop app. ", role="system")
    session.add_image(random_image(4, (4, 4), tiny.processor.patch_size))
    session.add_segment(segment, seam=1)
    session.add_text(" Now the dialog is open.")
    session.prefill()
    assert session.last_prefill.reused == segment.length - 1  # transplanted: spliced after its seam
    before = session.live.segment()
    session.edit("button", "Dismiss", "suffix")
    after = session.live.segment()
    rendered = session.prompt_layout(None, add_generation_prompt=False, trace=True)
    begin = rendered.field_spans["button"][0]
    assert begin > before.token_ids.tolist().index(
        int(segment.token_ids[1])
    )  # the field is inside the segment
    assert torch.equal(after.keys[:, :, :, :begin], before.keys[:, :, :, :begin])  # prefix untouched
    context = mmkv.segments_to_cache([before.slice(0, begin)], tiny.text_config)
    expected = prefill_span(
        tiny, after.token_ids[begin:], after.position_ids[:, begin:], context=context
    ).segment
    assert (after.keys[:, :, :, begin:] - expected.keys).abs().max() <= 1e-5
    assert (after.values[:, :, :, begin:] - expected.values).abs().max() <= 1e-5
    assert "labelled Dismiss;" in tiny.tokenizer.decode(after.token_ids)


def test_bad_segments_are_refused(tiny):
    session = mmkv.Session(tiny)
    plain = prefill_span(tiny, *text_span([5, 6, 7], 0)).segment
    try:
        session.add_segment(plain)
    except TypeError as exc:
        assert "TextSegment from mmkv.text.precompile" in str(exc)
    else:
        raise AssertionError("a plain KVSegment was accepted")
    try:
        precompile(tiny, "")
    except ValueError as exc:
        assert "non-empty" in str(exc)
    else:
        raise AssertionError("empty text was accepted")
    assert session.messages == []
