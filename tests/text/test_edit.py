"""Field edits (mmkv.text.edit): each strategy does exactly what it claims to the live cache, and suffix/full are
exact against a session that never saw the old value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmkv
from mmkv.text import STRATEGIES
from tests.conftest import random_image

POLICY = "Policy. account_role: {role}. If the badge is red, an admin approves and anyone else escalates."
REST = "Here is the screen. Decide the next action now and answer with one tool call."
QUESTION = "What is the next action?"


def _session(handle, role: str, **kwargs) -> mmkv.Session:
    session = mmkv.Session(handle, **kwargs)
    session.add_text(POLICY, role="system", fields={"role": role})
    session.add_image(random_image(3, (4, 6), handle.processor.patch_size))
    session.add_text(REST)
    return session


def _token_count(handle, text: str) -> int:
    return len(handle.processor.encode_text(text))


def _same_length_values(handle) -> tuple[str, str]:
    """Two role values with the same token count in this tokenizer (so no position moves)."""
    candidates = ["admin", "viewer", "owner", "guest", "staff", "agent", "editor", "member"]
    by_count: dict[int, list[str]] = {}
    for value in candidates:
        by_count.setdefault(_token_count(handle, " " + value), []).append(value)
    pair = next(values for values in by_count.values() if len(values) >= 2)
    return pair[0], pair[1]


def _changed_entries(before: mmkv.KVSegment, after: mmkv.KVSegment) -> set[int]:
    """Cache entries whose K or V differ in any layer (same length required)."""
    assert before.length == after.length
    differs = (before.keys != after.keys) | (before.values != after.values)  # (layers, 1, H, L, D)
    return set(differs.any(dim=4).any(dim=2).any(dim=1).any(dim=0).nonzero().flatten().tolist())


def _prefilled(handle, role: str):
    """A prefilled session, its live cache before any edit, and the field's token span."""
    session = _session(handle, role)
    session.prefill()
    rendered = session.prompt_layout(None, add_generation_prompt=False, trace=True)
    return session, session.live.segment(), rendered.field_spans["role"]


def _reference_logits(handle, role: str) -> torch.Tensor:
    return _session(handle, role, reuse="none").next_token_logits(QUESTION)


@pytest.mark.parametrize("strategy", ["suffix", "full"])
def test_suffix_and_full_equal_recompute_with_the_new_value(tiny, strategy):
    session = _session(tiny, "verified_admin")
    session.ask("Who am I?", max_new_tokens=3)  # a live cache with an answer in it
    report = session.edit("role", "viewer", strategy)
    reference = session.fork(reuse="none")  # same conversation, never cached
    edited = session.next_token_logits(QUESTION)
    assert (edited - reference.next_token_logits(QUESTION)).abs().max() <= 1e-4
    assert report.strategy == strategy and report.old == "verified_admin" and report.new == "viewer"
    assert session.field_values["role"] == "viewer"
    if strategy == "full":
        assert report.recomputed == report.context_tokens and report.fraction == 1.0
    else:
        assert 0 < report.recomputed < report.context_tokens


def test_suffix_recomputes_from_the_field_on(tiny):
    session = _session(tiny, "admin")
    session.prefill()
    rendered = session.prompt_layout(None, add_generation_prompt=False, trace=True)
    field_begin = rendered.field_spans["role"][0]
    report = session.edit("role", "viewer", "suffix")
    assert report.recomputed == report.context_tokens - field_begin


def test_erratum_keeps_every_prefix_tensor_and_only_appends(tiny):
    session = _session(tiny, "admin")
    session.prefill()
    before = session.live.segment()
    report = session.edit("role", "viewer", "erratum")
    after = session.live.segment()
    n = before.length
    assert torch.equal(after.keys[:, :, :, :n], before.keys)
    assert torch.equal(after.values[:, :, :, :n], before.values)
    assert torch.equal(after.token_ids[:n], before.token_ids)
    assert report.recomputed == after.length - n > 0  # the erratum message, nothing else
    text = tiny.tokenizer.decode(after.token_ids[n:])
    assert "[STATE UPDATE] role has just changed to viewer" in text and text.startswith(("<|im_start|>system", "<|system|>"))
    assert "account_role: admin" in tiny.tokenizer.decode(after.token_ids[:n])  # the old text stays
    assert session.field_values["role"] == "viewer"
    # the erratum is part of the conversation: a fresh session renders the same prompt
    assert torch.equal(session.render(QUESTION)[0], session.fork(reuse="none").render(QUESTION)[0])


def test_erratum_text_and_role_are_configurable(tiny):
    session = _session(tiny, "admin")
    session.edit("role", "viewer", "erratum", erratum="NOTE: {field} is now {value}.", erratum_role="user")
    assert session.messages[-1] == {
        "role": "user",
        "content": [{"type": "text", "text": "NOTE: role is now viewer.", "item_id": 2}],
    }


def test_in_place_changes_exactly_the_field_tokens(tiny):
    old, new = _same_length_values(tiny)
    session, before, (begin, end) = _prefilled(tiny, old)
    report = session.edit("role", new, "in_place")
    after = session.live.segment()
    assert _changed_entries(before, after) == set(range(begin, end))
    assert report.recomputed == end - begin
    assert tiny.tokenizer.decode(after.token_ids[begin:end]).strip() == new
    # the field's own tokens are exact: they only see the unchanged prefix
    reference = _session(tiny, new, reuse="none")
    reference.prefill()
    exact = reference.live.segment()
    assert torch.allclose(after.keys[:, :, :, begin:end], exact.keys[:, :, :, begin:end], atol=1e-5)
    assert torch.allclose(after.values[:, :, :, begin:end], exact.values[:, :, :, begin:end], atol=1e-5)


def test_in_place_with_another_token_count_rerotates_what_follows(tiny):
    session, before, (_, old_end) = _prefilled(tiny, "admin")
    session.edit("role", "verified_external_auditor", "in_place")
    after = session.live.segment()
    delta = after.length - before.length
    assert delta > 0
    moved = before.slice(old_end).moved_to(int(before.position_ids[0, old_end]) + delta)
    assert torch.equal(after.values[:, :, :, old_end + delta :], moved.values)
    assert torch.equal(after.keys[:, :, :, old_end + delta :], moved.keys)
    assert torch.equal(after.position_ids[:, old_end + delta :], moved.position_ids)
    assert torch.equal(session.render(None, add_generation_prompt=False)[0], after.token_ids)


@pytest.mark.parametrize("rank", ["attention", "deviation"])
def test_selective_recomputes_exactly_the_field_and_k_tokens(tiny, rank):
    old, new = _same_length_values(tiny)
    session, before, (begin, end) = _prefilled(tiny, old)
    report = session.edit("role", new, "selective", k=5, rank=rank)
    assert len(report.selected) == 5 and all(i >= end for i in report.selected)
    assert report.recomputed == end - begin + 5
    assert _changed_entries(before, session.live.segment()) == set(range(begin, end)) | set(report.selected)


def test_selective_with_every_later_token_is_suffix(tiny):
    session = _session(tiny, "admin")
    session.prefill()
    report = session.edit("role", "viewer", "selective", k=10_000)
    reference = _reference_logits(tiny, "viewer")
    assert (session.next_token_logits(QUESTION) - reference).abs().max() <= 1e-4
    assert report.fraction < 1.0


def test_attention_ranking_picks_the_most_attended_tokens(tiny):
    """The attention ranking agrees with the eager attention of the last position, computed independently."""
    old, new = _same_length_values(tiny)
    session = _session(tiny, old)
    session.prefill()
    ids, positions = session.live.token_ids, session.live.positions
    model = tiny.model
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(
                input_ids=ids[None],
                position_ids=positions[:, None],
                output_attentions=True,
                mm_token_type_ids=(ids == tiny.processor.image_token_id).int()[None],
                pixel_values=tiny.processor.preprocess_images([session.images[0].pixels]).pixel_values,
                image_grid_thw=torch.tensor([session.images[0].grid]),
            )
    finally:
        model.set_attn_implementation("sdpa")
    weights = torch.stack([a[0, :, -1] for a in out.attentions]).mean((0, 1))  # (L,)
    rendered = session.prompt_layout(None, add_generation_prompt=False, trace=True)
    end = rendered.field_spans["role"][1]
    expected = set((torch.topk(weights[end:], 4).indices + end).tolist())
    assert set(session.edit("role", new, "selective", k=4).selected) == expected


def test_in_place_is_not_exact_but_suffix_is(tiny):
    """The stale tail is real: in-place differs from recompute where suffix does not."""
    reference = _reference_logits(tiny, "viewer")
    gaps = {}
    for strategy in ("in_place", "suffix"):
        session = _session(tiny, "admin")
        session.prefill()
        session.edit("role", "viewer", strategy)
        gaps[strategy] = float((session.next_token_logits(QUESTION) - reference).abs().max())
    assert gaps["suffix"] <= 1e-4 < gaps["in_place"]


def test_bad_edits_raise_and_change_nothing(tiny):
    session = _session(tiny, "admin")
    session.prefill()
    before = session.live.segment()
    messages = session.fork().messages
    with pytest.raises(ValueError, match="unknown edit strategy 'rewrite'"):
        session.edit("role", "viewer", "rewrite")
    with pytest.raises(KeyError, match="no field 'team'.*fields: \\['role'\\]"):
        session.edit("team", "red", "suffix")
    with pytest.raises(TypeError, match="non-empty str"):
        session.edit("role", "", "suffix")
    with pytest.raises(ValueError, match="unknown ranking"):
        session.edit("role", "viewer", "selective", rank="random")
    assert session.fork().messages == messages and session.field_values == {"role": "admin"}
    assert torch.equal(session.live.segment().keys, before.keys)


def test_field_declarations_are_checked(tiny):
    session = mmkv.Session(tiny)
    with pytest.raises(ValueError, match="placeholder \\{team\\} once, found 0"):
        session.add_text("no placeholder here", fields={"team": "red"})
    with pytest.raises(ValueError, match="cannot be empty"):
        session.add_text("team: {team}", fields={"team": ""})
    session.add_text("team: {team}", fields={"team": "red"})
    with pytest.raises(ValueError, match="'team' already exists"):
        session.add_text("other team: {team}", fields={"team": "blue"})
    assert (
        session.messages[0]["content"][0]["text"] == "team: red" and len(session.messages[0]["content"]) == 1
    )


def test_field_spans_cover_the_value_tokens(tiny):
    session = _session(tiny, "verified_admin")
    rendered = session.prompt_layout(None, trace=True)
    begin, end = rendered.field_spans["role"]
    assert tiny.tokenizer.decode(rendered.token_ids[begin:end]).strip() == "verified_admin"
    assert torch.equal(rendered.token_ids, session.fork(reuse="none").render(None)[0])


def test_every_strategy_reports_what_it_did(tiny):
    for strategy in STRATEGIES:
        session = _session(tiny, "admin")
        report = session.edit("role", "viewer", strategy, **({"k": 3} if strategy == "selective" else {}))
        assert report.seconds > 0 and 0 < report.fraction <= 1
        assert report.context_tokens == session.live.num_tokens
        assert np.isclose(report.fraction, report.recomputed / report.context_tokens)
