"""The model thread: one thread that steps the server's ``EngineCore`` while it has work.

Every request's model work runs here, batched (``mmkv.engine``): a new request's prefill runs between the
running requests' decode steps, all running requests decode in one forward call, up to ``--max-batch`` at once
(``--max-batch 1``: one request at a time, in order of arrival). What is not model work happens before a
request reaches this thread (``Engine.prepare``, on the request's own worker thread: images decoded and
preprocessed, messages rendered and laid out, the grammar compiled) or after (the event loop: replies).

A ``Job`` is the server's side of one request: the engine ``Request`` and the asyncio queue its events reach
the event loop on (``Started``, ``First``, one ``Delta`` per token, ``Done`` or ``Failed``: ``mmkv.engine``). A
job withdrawn while queued (its client went away) leaves the queue at once; one withdrawn or past its deadline
while prefilling or decoding leaves at the engine's next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from ..cache import EncoderStore, KVStore
from ..cache.memory import MemoryTier
from ..engine import EngineConfig, EngineCore, Request, Started
from ..model.handle import ModelHandle
from ..runtime import TurnPolicy, TurnStores
from .heap import HeapTrim
from .metrics import Metrics
from .pool import LivePool

__all__ = ["Job", "Worker"]

log = logging.getLogger("mmkv.serve")


@dataclass(eq=False)
class Job:
    """One request's engine record and the channel its events come back on (to the event loop)."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None  # set once built (``Engine.prepare``)
    checked: float = field(default_factory=time.monotonic)  # when the client was last seen connected
    metrics: Metrics | None = None  # where its queue wait is counted

    def emit(self, event) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        if isinstance(event, Started) and self.metrics is not None:
            self.metrics.queue_wait.observe(event.queue_s)
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    @property
    def deadline(self) -> float:
        return self.request.deadline


class Worker:
    """Steps one ``EngineCore`` on its own thread (started on construction)."""

    def __init__(
        self,
        handle: ModelHandle,
        kv_store: KVStore,
        encoder_store: EncoderStore,
        vision_inputs: MemoryTier,
        pool: LivePool,
        metrics: Metrics,
        config: EngineConfig,
    ) -> None:
        self.handle, self.kv_store, self.encoder_store = handle, kv_store, encoder_store
        self.vision_inputs = vision_inputs  # preprocessed vision-tower inputs by digest
        self.pool, self.metrics = pool, metrics
        self.core = EngineCore(handle, config, self._turn_stores, pool)
        self.heap = HeapTrim()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="mmkv-model-worker", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return self.core.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        """Requests prefilling or decoding."""
        scheduler = self.core.scheduler
        return len(scheduler.running) + (scheduler.prefilling is not None)

    def submit(self, request: Request) -> None:
        """Queue ``request``; ``QueueFull`` when the queue is at capacity."""
        self.core.add(request)
        self.metrics.queue_depth.set(self.num_waiting)
        with self._wake:
            self._wake.notify()

    def withdraw(self, request: Request) -> None:
        """Drop a request (its client went away): at once while queued, else at the next step."""
        self.core.withdraw(request)
        self.metrics.queue_depth.set(self.num_waiting)

    def close(self) -> None:
        """Stop the model thread after the step it is in (its bookkeeping done) and wait for it; requests
        still queued or running get no further events. Idempotent; from the model thread itself it only
        asks the loop to stop."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _turn_stores(self, policy: TurnPolicy) -> TurnStores:
        return TurnStores(self.handle, self.kv_store, self.encoder_store, policy, self.vision_inputs)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self.core.has_work():
                    self._wake.wait()
                if self._closed:
                    return
            finished = self.core.step()
            metrics = self.metrics
            metrics.queue_depth.set(self.num_waiting)
            metrics.running.set(self.num_running)
            if self.core.last_decode_rows:
                metrics.decode_rows.observe(self.core.last_decode_rows)
            for _ in finished:
                self.heap.tick()  # every 64th request: freed memory back to the system (see heap.py)
            if finished:
                metrics.pool_entries.set(self.pool.num_entries)
                metrics.pool_bytes.set(self.pool.num_bytes)
