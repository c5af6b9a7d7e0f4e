"""``Scheduler``: FIFO admission within max_batch and the KV bound, one prefill at a time, a bounded queue,
and waiting requests that are cancelled or out of time dropped at the next step."""

from __future__ import annotations

import time

import pytest

from mmkv.engine import EngineConfig, QueueFull, Scheduler, Status
from mmkv.runtime import DecodeOptions
from tests.engine.conftest import conversation, request_of


def _requests(handle, n, **kwargs):
    return [request_of(conversation(handle, k), DecodeOptions(4), **kwargs)[0] for k in range(n)]


def test_admission_is_in_order_one_prefill_at_a_time_within_max_batch(tiny):
    """Three requests, max_batch 2: a prefills; b only once a runs; c waits while two run, then enters when one
    finishes."""
    a, b, c = _requests(tiny, 3)
    scheduler = Scheduler(EngineConfig(max_batch=2), tiny.kv_bytes_per_token)
    for r in (a, b, c):
        scheduler.add(r)
    assert scheduler.schedule().admitted is a and a.status is Status.PREFILLING
    assert scheduler.schedule().admitted is None  # a still prefilling: the slot is taken
    scheduler.prefilled(a)
    plan = scheduler.schedule()
    assert plan.admitted is b and plan.decode == (a,)
    scheduler.prefilled(b)
    assert scheduler.schedule().admitted is None and scheduler.num_waiting == 1
    scheduler.finish(a)
    assert scheduler.schedule().admitted is c and a.status is Status.FINISHED


def test_the_queue_is_bounded_and_withdrawal_is_immediate(tiny):
    """max_waiting 2: a third add raises QueueFull and queues nothing; a withdrawn waiting request leaves at
    once (FINISHED, never admitted)."""
    a, b, c = _requests(tiny, 3)
    scheduler = Scheduler(EngineConfig(max_waiting=2), tiny.kv_bytes_per_token)
    scheduler.add(a)
    scheduler.add(b)
    with pytest.raises(QueueFull):
        scheduler.add(c)
    assert scheduler.num_waiting == 2
    assert scheduler.withdraw(a) and a.status is Status.FINISHED and scheduler.num_waiting == 1
    assert scheduler.schedule().admitted is b


@pytest.mark.parametrize("fault", ["cancelled", "expired"])
def test_waiting_requests_that_must_stop_are_dropped_not_admitted(tiny, fault):
    """A waiting request cancelled (by its flag alone) or past its deadline is in the next plan's dropped, never
    admitted; the one behind it is."""
    (a,) = _requests(tiny, 1, deadline=time.monotonic() - 1 if fault == "expired" else None)
    (b,) = _requests(tiny, 1)
    if fault == "cancelled":
        a.cancel()
    scheduler = Scheduler(EngineConfig(), tiny.kv_bytes_per_token)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert plan.dropped == (a,) and plan.admitted is b and a.status is Status.FINISHED


def test_a_head_that_does_not_fit_is_not_overtaken(tiny):
    """Under a KV bound that fits one row, the waiting head waits while a request runs, and nothing behind it is
    admitted before it."""
    a, b, c = _requests(tiny, 3)
    bound = max(r.kv_tokens() for r in (a, b, c)) * tiny.kv_bytes_per_token
    scheduler = Scheduler(EngineConfig(max_batch_kv_bytes=bound), tiny.kv_bytes_per_token)
    for r in (a, b, c):
        scheduler.add(r)
    scheduler.schedule()
    scheduler.prefilled(a)
    assert scheduler.schedule().admitted is None and scheduler.num_waiting == 2
    scheduler.finish(a)
    assert scheduler.schedule().admitted is b


def test_config_is_validated():
    """Bounds out of range are refused when the config is built."""
    for bad in (dict(max_batch=0), dict(max_batch_kv_bytes=0), dict(prefill_chunk=4), dict(max_waiting=-1)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
