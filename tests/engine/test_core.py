"""The engine's step: batched runs give the answers of serial runs (greedy, seeded sampling, grammars, stops,
logprobs), requests join and leave a running batch without disturbing the others, chunked prefills interleave
with decoding, and a cancelled or expired request leaves at the next step."""

from __future__ import annotations

import time

import pytest

from mmkv.engine import EngineConfig, Started, Status
from mmkv.runtime import DecodeOptions, LogitRules, Sampling
from mmkv.runtime.grammar import constraint_for, json_schema
from tests.engine.conftest import BATCHED, SERIAL, Stores, conversation, request_of, run

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}  # fmt: skip


def _mix(handle):
    """Eight requests of different lengths and settings: greedy, seeded sampling, a stop, logprobs, logit
    rules, a JSON grammar, and two with several images (the shared one spliced elsewhere each time)."""
    cases = []
    for k in range(8):
        session = conversation(handle, k, images=1 + (k % 3 == 2))
        sampling = Sampling(0.8, 0.9, seed=k) if k in (1, 5) else Sampling()
        ordinary = len(handle.family.special_tokens) + 7  # the tiny tokenizers put the special tokens first
        rules = LogitRules(presence_penalty=0.5, logit_bias=((ordinary, 2.0),)) if k == 3 else LogitRules()
        options = DecodeOptions(6 + 3 * k, sampling, ("e",) if k == 4 else (), 3, rules)
        grammar = json_schema(SCHEMA) if k == 6 else None
        cases.append((session, options, grammar))
    return cases


def _requests(handle, cases):
    made = []
    for session, options, grammar in cases:
        constraint = None if grammar is None else constraint_for(handle, grammar)
        made.append(request_of(session, options, constraint=constraint))
    return made


def _same_up_to_ties(batched, serial) -> None:
    """Tokens equal; logprobs within 1e-4. Where a token differs, it must be a near tie (the two choices' serial
    logprobs within 1e-4), and the answers are compared up to there only: nothing changes silently."""
    b, s = batched.answer, serial.answer
    for i, (tb, ts) in enumerate(zip(b.token_ids, s.token_ids, strict=False)):
        if tb != ts:
            top = {alt.token_id: alt.logprob for alt in s.logprobs[i].top}
            assert tb in top and abs(top[tb] - s.logprobs[i].logprob) < 1e-4, f"token {i} differs, no tie"
            return
        assert abs(b.logprobs[i].logprob - s.logprobs[i].logprob) < 1e-4
    assert b.token_ids == s.token_ids and b.text == s.text and b.finish_reason == s.finish_reason


def test_a_batched_run_answers_as_a_serial_run(tiny):
    """Eight mixed requests decoded together give the tokens, texts, finish reasons and logprobs (1e-4) of the
    same requests one at a time, and the batch really ran them together."""
    cases = _mix(tiny)
    serial = _requests(tiny, cases)
    run(Stores(tiny), [r for r, _ in serial], SERIAL)
    batched = _requests(tiny, cases)
    widths = []
    core = run(
        Stores(tiny), [r for r, _ in batched], BATCHED, between=lambda c: widths.append(len(c.runner.batch))
    )
    assert max(widths) >= 6  # most of them decoded in one forward call
    assert core.decode_steps < sum(len(o.answer.token_ids) for _, o in serial)
    for (_, b), (_, s) in zip(batched, serial, strict=True):
        assert b.failed is None and s.failed is None
        _same_up_to_ties(b, s)


def test_finished_requests_hand_back_the_cache_decoding_alone_leaves(tiny):
    """After a batched run each live cache holds what a serial run's holds: the same ids and positions, and
    K/V within float32 rounding."""
    cases = _mix(tiny)[:4]
    serial, batched = _requests(tiny, cases), _requests(tiny, cases)
    run(Stores(tiny), [r for r, _ in serial], SERIAL)
    run(Stores(tiny), [r for r, _ in batched], BATCHED)
    for (rb, _), (rs, _) in zip(batched, serial, strict=True):
        assert rb.live.num_tokens == rs.live.num_tokens
        assert (rb.live.token_ids == rs.live.token_ids).all() and (
            rb.live.positions == rs.live.positions
        ).all()
        for lb, ls in zip(rb.live.cache.layers, rs.live.cache.layers, strict=True):
            assert (lb.keys - ls.keys).abs().max() < 1e-4 and (lb.values - ls.values).abs().max() < 1e-4


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(tiny):
    """With prefill_chunk 16, a request arriving while another decodes is prefilled over several steps, each
    of which also decodes the running one; its answer is the one an unchunked serial run gives (up to ties)."""
    long = conversation(tiny, 7, images=2)
    first, first_out = request_of(conversation(tiny, 1), DecodeOptions(40, logprobs=2))
    late, late_out = request_of(long, DecodeOptions(8, logprobs=2))
    reference, reference_out = request_of(long, DecodeOptions(8, logprobs=2))
    warm, _ = request_of(conversation(tiny, 1), DecodeOptions(40, logprobs=2))  # stores its image, as `first`
    run(Stores(tiny), [warm, reference], SERIAL)
    stores = Stores(tiny)
    config = EngineConfig(max_batch=4, prefill_chunk=16)
    from mmkv.engine import EngineCore

    core = EngineCore(tiny, config, stores.turn_stores)
    core.add(first)
    while first.status is not Status.RUNNING:
        core.step()
    core.add(late)
    overlapped = 0
    while late.status is not Status.RUNNING:
        before = len(first_out.events)
        core.step()
        overlapped += late.status is Status.PREFILLING and len(first_out.events) > before
    while core.has_work():
        core.step()
    assert late.layout.num_tokens > 4 * 16 and overlapped >= 3  # several chunks, each beside a decode step
    _same_up_to_ties(late_out, reference_out)
    assert first_out.answer is not None


@pytest.mark.parametrize("when", ["waiting", "prefilling", "running"])
def test_a_cancelled_request_leaves_without_disturbing_the_others(tiny, when):
    """A request cancelled while waiting, prefilling or decoding hears nothing more and leaves the engine at
    the next step; the others' answers are those of a run without it."""
    cases = _mix(tiny)[:4]
    alone = _requests(tiny, cases[:3])
    run(Stores(tiny), [r for r, _ in alone], BATCHED)
    requests = _requests(tiny, cases)
    victim, victim_out = requests[3]
    config = EngineConfig(max_batch=4, prefill_chunk=16 if when == "prefilling" else None)

    def cancel(core):
        if victim.status.value == when and not victim.is_cancelled:
            victim.cancel()
            cancel.heard = len(victim_out.events)

    cancel.heard = None
    run(Stores(tiny), [r for r, _ in requests], config, between=cancel)
    if when == "waiting":  # admitted at once when batched: cancel it before the run instead
        assert cancel.heard is not None or victim.status is Status.FINISHED
    assert victim.status is Status.FINISHED and victim_out.answer is None
    if cancel.heard is not None:
        assert len(victim_out.events) == cancel.heard  # nothing after the cancellation took effect
    for (_, b), (_, s) in zip(requests[:3], alone, strict=True):
        _same_up_to_ties(b, s)


def test_an_expired_request_fails_in_the_queue_and_others_run(tiny):
    """With max_batch 1, a queued request whose deadline passes fails with a TimeoutError without model work;
    the running one finishes."""
    a, a_out = request_of(conversation(tiny, 0), DecodeOptions(4))
    b, b_out = request_of(conversation(tiny, 1), DecodeOptions(4), deadline=time.monotonic() - 1)
    run(Stores(tiny), [a, b], SERIAL)
    assert a_out.answer is not None
    assert isinstance(b_out.failed, TimeoutError) and not any(isinstance(e, Started) for e in b_out.events)


def test_max_batch_one_runs_requests_one_at_a_time_in_order(tiny):
    """max_batch 1: the batch never holds two rows, and requests start in order of arrival."""
    requests = _requests(tiny, _mix(tiny)[:3])
    started = []
    widths = []

    def watch(core):
        widths.append(len(core.runner.batch))
        started.extend(
            r for r, o in requests if any(isinstance(e, Started) for e in o.events) and r not in started
        )

    run(Stores(tiny), [r for r, _ in requests], SERIAL, between=watch)
    assert max(widths) == 1 and started == [r for r, _ in requests]


def test_the_kv_bound_keeps_requests_waiting(tiny):
    """A KV bound that fits one padded row admits the second request only after the first leaves."""
    a, a_out = request_of(conversation(tiny, 0), DecodeOptions(8))
    b, b_out = request_of(conversation(tiny, 1), DecodeOptions(8))
    per_row = max(a.kv_tokens(), b.kv_tokens()) * tiny.kv_bytes_per_token
    config = EngineConfig(max_batch=8, max_batch_kv_bytes=per_row + 1, prefill_chunk=None)
    widths = []
    run(Stores(tiny), [a, b], config, between=lambda c: widths.append(len(c.runner.batch)))
    assert max(widths) == 1 and a_out.answer is not None and b_out.answer is not None
