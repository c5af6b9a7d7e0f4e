"""The model thread: requests submitted to a ``Worker`` hear the events of a core stepped by hand, in order, on
their event loop; a request withdrawn while queued hears nothing; a full queue refuses at once; the metrics
follow the engine; ``close`` stops the thread, from outside or from the thread itself.

The model thread is held at a known point by a request whose ``emit`` blocks (``emit`` runs on the model
thread), so nothing here depends on timing."""

from __future__ import annotations

import asyncio
import threading

import pytest

import mmkv
from mmkv.engine import Delta, Done, EngineConfig, Failed, First, QueueFull, Request, Started
from mmkv.runtime import DecodeOptions, TurnPolicy
from mmkv.serve.metrics import Metrics
from mmkv.serve.pool import LivePool
from mmkv.serve.worker import Job, Worker
from tests.engine.conftest import SERIAL, Stores, conversation, request_of, run
from tests.helpers import metric_value

CONFIG = EngineConfig(max_batch=1, prefill_chunk=None, max_waiting=2)


@pytest.fixture(scope="module")
def handle() -> mmkv.ModelHandle:
    return mmkv.load("tiny-qwen3-vl", device="cpu")  # the thread is the same for every family


def _worker(handle, stores: Stores, config=CONFIG) -> tuple[Worker, Metrics, LivePool]:
    metrics, pool = Metrics(), LivePool(handle, 64 << 20)
    worker = Worker(handle, stores.kv, stores.encoder, stores.vision_inputs, pool, metrics, config)
    return worker, metrics, pool


def _request(handle, k: int, emit, tokens: int = 5) -> Request:
    session = conversation(handle, k)
    return Request(session.prompt_layout(None), session.images, TurnPolicy(), DecodeOptions(tokens), emit)


async def _events(job: Job) -> list:
    """Every event ``job`` hears, through ``Done`` or ``Failed``."""
    heard = []
    while not heard or not isinstance(heard[-1], Done | Failed):
        heard.append(await asyncio.wait_for(job.events.get(), 120))
    return heard


def test_submitted_requests_hear_in_order_what_a_core_stepped_by_hand_answers(handle):
    """Three requests through the worker get the tokens of the same requests run through an ``EngineCore``
    stepped on this thread, each as Started, First, one Delta per token, Done; afterwards the queue and the
    batch gauges read 0 and the queue-wait histogram counted each request once."""
    serial = [request_of(conversation(handle, k), DecodeOptions(5)) for k in range(3)]
    run(Stores(handle), [r for r, _ in serial], SERIAL)
    worker, metrics, pool = _worker(handle, Stores(handle))

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(loop, metrics=metrics) for _ in range(3)]
        for k, job in enumerate(jobs):
            job.request = _request(handle, k, job.emit)
            worker.submit(job.request)
        return [await _events(job) for job in jobs]

    try:
        heard = asyncio.run(main())
    finally:
        worker.close()
    for events, (_, outcome) in zip(heard, serial, strict=True):
        answer = events[-1].answer
        assert answer.token_ids == outcome.answer.token_ids and answer.text == outcome.answer.text
        assert [type(e) for e in events] == [Started, First, *[Delta] * len(answer.token_ids), Done]
        assert tuple(e.step.token for e in events[2:-1]) == answer.token_ids
    assert metric_value(metrics, "mmkv_queue_depth") == 0 and metric_value(metrics, "mmkv_running_requests") == 0
    assert metric_value(metrics, "mmkv_queue_wait_seconds_sum") >= 0
    assert metric_value(metrics, "mmkv_queue_wait_seconds_count") == 3
    assert metric_value(metrics, "mmkv_pool_entries") == pool.num_entries > 0


def test_a_request_withdrawn_while_queued_hears_nothing_and_a_full_queue_refuses(handle):
    """While the model thread is held inside the first request's step, two more queue (``max_waiting`` 2), a
    third is refused with ``QueueFull`` and queues nothing, and one withdrawn leaves the queue at once; after
    the thread goes on, the withdrawn one has heard nothing and the others their whole answers."""
    worker, metrics, _ = _worker(handle, Stores(handle))
    held, release = threading.Event(), threading.Event()
    heard_first: list = []

    def hold(event) -> None:
        if isinstance(event, First):
            held.set()
            assert release.wait(120)
        heard_first.append(event)

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        first = _request(handle, 0, lambda e: (hold(e), isinstance(e, Done) and loop.call_soon_threadsafe(
            done.set_result, None)))  # fmt: skip
        worker.submit(first)
        assert await loop.run_in_executor(None, held.wait, 120)
        jobs = [Job(loop, metrics=metrics) for _ in range(3)]
        for k, job in enumerate(jobs[:2], start=1):
            job.request = _request(handle, k, job.emit)
            worker.submit(job.request)
        jobs[2].request = _request(handle, 3, jobs[2].emit)
        with pytest.raises(QueueFull):
            worker.submit(jobs[2].request)
        assert worker.num_waiting == 2 and worker.num_running == 1
        worker.withdraw(jobs[0].request)
        assert worker.num_waiting == 1 and metric_value(metrics, "mmkv_queue_depth") == 1
        release.set()
        await done
        second = await _events(jobs[1])
        await asyncio.sleep(0)
        return jobs, second

    try:
        jobs, second = asyncio.run(main())
    finally:
        release.set()
        worker.close()
    assert isinstance(heard_first[-1], Done) and isinstance(second[-1], Done)
    assert jobs[0].events.empty() and jobs[2].events.empty()
    assert not worker.core.has_work()


def test_close_stops_the_thread_from_outside_and_from_the_thread_itself(handle):
    """``close`` twice from outside joins a stopped thread; ``close`` called by an event the model thread
    emits only asks the loop to stop (no self-join), and the thread ends after that step."""
    worker, _, _ = _worker(handle, Stores(handle))
    worker.close()
    worker.close()
    assert not worker._thread.is_alive()

    worker, _, _ = _worker(handle, Stores(handle))
    closed = threading.Event()

    def close_on_done(event) -> None:
        if isinstance(event, Done):
            worker.close()  # on the model thread
            closed.set()

    worker.submit(_request(handle, 0, close_on_done))
    assert closed.wait(120)
    worker._thread.join(120)
    assert not worker._thread.is_alive()


def test_only_started_events_count_queue_wait():
    """``Job.emit`` observes the wait of a ``Started`` event and of nothing else; every event reaches the
    job's queue in order."""

    async def main():
        metrics = Metrics()
        job = Job(asyncio.get_running_loop(), metrics=metrics)
        events = [Started(0.25), Done(None), Started(0.5)]
        for event in events:
            job.emit(event)
        await asyncio.sleep(0)
        return metrics, [job.events.get_nowait() for _ in events], events

    metrics, heard, events = asyncio.run(main())
    assert heard == events
    assert metric_value(metrics, "mmkv_queue_wait_seconds_count") == 2
    assert metric_value(metrics, "mmkv_queue_wait_seconds_sum") == 0.75
