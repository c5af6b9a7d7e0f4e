"""The model worker: one thread that runs requests one at a time, in order of arrival, from a bounded queue.

Why one worker: the model runs on one device and mmkv's turns build per-sequence ``DynamicCache`` s spliced
at arbitrary positions; running requests one at a time keeps each answer exactly what a ``Session`` would give
and memory predictable. Continuous batching would need paged KV (a request's cache as pages that splices can
point into), a scheduler interleaving prefill chunks with decode steps, and batched M-RoPE positions and
masks over sequences of different lengths: a different engine (vLLM's), which mmkv's records could feed.

A ``Job`` carries a request's conversation and settings in, and typed events out (to the request's asyncio
queue, via the event loop): ``Started``, ``First`` (the prefill's stats and TTFT), one ``Delta`` per decoded
token, then ``Done`` (the ``Answer``) or ``Failed`` (the exception). A job cancelled while queued (its client
went away) leaves the queue at once; one cancelled or past its deadline while decoding stops at the next token
(the decoder's ``should_stop``).

A request's path on the worker (``Worker._run``): 1. lay the conversation out with the server's one
``LayoutBuilder`` (blocks and earlier requests' assemblies by content: only what is new is rendered); 2. check
out the pool entry sharing the longest prefix, with that prefix's length; 3. ``run_turn`` from it (plan,
splice, one forward call; store writes after the first token); 4. decode with the one ``Decoder``; 5. check the
live cache back in.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache import EncoderStore, KVStore
from ..cache.memory import MemoryTier
from ..conversation import Conversation
from ..model.handle import ModelHandle
from ..prompt.blocks import LayoutBuilder
from ..runtime import (
    Answer,
    DecodeOptions,
    Decoder,
    DecodeStep,
    TokenConstraint,
    TurnPolicy,
    TurnSources,
    run_turn,
)
from ..runtime.report import PrefillStats
from .heap import HeapTrim
from .metrics import Metrics
from .pool import LivePool

__all__ = ["Delta", "Done", "Failed", "First", "Job", "QueueFull", "Started", "Worker"]


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


@dataclass(frozen=True)
class Started:
    """The worker took the job."""

    queue_s: float  # seconds it waited in the queue


@dataclass(frozen=True)
class First:
    """The prompt is prefilled: the first token's logits are known."""

    stats: PrefillStats
    ttft_s: float


@dataclass(frozen=True)
class Delta:
    """One decoded token."""

    step: DecodeStep


@dataclass(frozen=True)
class Done:
    """The answer is complete."""

    answer: Answer


@dataclass(frozen=True)
class Failed:
    """The job failed; ``error`` says why (the HTTP layer chooses the status by its type)."""

    error: BaseException


@dataclass
class Job:
    """One request's work and the channel its events go back on."""

    conversation: Conversation
    policy: TurnPolicy
    options: DecodeOptions
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    deadline: float  # time.monotonic() after which the job is abandoned
    constraint: TokenConstraint | None = None  # a grammar the answer must follow (tools, response_format)
    submitted: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def should_stop(self) -> bool:
        """Whether decoding must stop now: the client went away or the deadline passed."""
        return self.cancelled.is_set() or time.monotonic() > self.deadline


class _JobQueue:
    """A bounded FIFO whose jobs can be removed while waiting (a disconnected client)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._jobs: deque[Job] = deque()
        self._ready = threading.Condition()
        self.closed = False

    def put(self, job: Job) -> None:
        with self._ready:
            if len(self._jobs) >= self.capacity:
                raise QueueFull
            self._jobs.append(job)
            self._ready.notify()

    def remove(self, job: Job) -> bool:
        with self._ready:
            try:
                self._jobs.remove(job)
                return True
            except ValueError:
                return False

    def get(self) -> Job | None:
        with self._ready:
            while not self._jobs and not self.closed:
                self._ready.wait()
            return self._jobs.popleft() if self._jobs else None

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def __len__(self) -> int:
        return len(self._jobs)


class Worker:
    """Runs jobs on the model, one at a time, on its own thread (started on construction)."""

    def __init__(
        self,
        handle: ModelHandle,
        kv_store: KVStore,
        encoder_store: EncoderStore,
        pixels: MemoryTier,
        pool: LivePool,
        metrics: Metrics,
        max_queue: int,
        layout_cache_bytes: int = 64 << 20,
    ) -> None:
        self.handle, self.kv_store, self.encoder_store, self.pixels = handle, kv_store, encoder_store, pixels
        self.pool, self.metrics = pool, metrics
        self.layouts = LayoutBuilder(handle, layout_cache_bytes)  # one for all requests: kept by content
        self.queue = _JobQueue(max_queue)
        self.heap = HeapTrim()
        self._thread = threading.Thread(target=self._loop, name="mmkv-model-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; ``QueueFull`` when the queue is at capacity."""
        self.queue.put(job)
        self.metrics.queue_depth.set(len(self.queue))

    def withdraw(self, job: Job) -> None:
        """Take a job out of the queue if it is still waiting (its client went away)."""
        job.cancelled.set()
        self.queue.remove(job)
        self.metrics.queue_depth.set(len(self.queue))

    def close(self) -> None:
        self.queue.close()

    def _loop(self) -> None:
        while (job := self.queue.get()) is not None:
            self.metrics.queue_depth.set(len(self.queue))
            if job.cancelled.is_set():
                continue
            try:
                self._run(job)
            except Exception as exc:  # the HTTP layer turns it into an error object by its type
                job.emit(Failed(exc))
            self.heap.tick()  # every 64th request: freed memory back to the system (see heap.py)

    def _run(self, job: Job) -> None:
        queue_s = time.monotonic() - job.submitted
        self.metrics.queue_wait.observe(queue_s)
        if time.monotonic() > job.deadline:  # its time ran out in the queue: no model work for it
            job.emit(Failed(TimeoutError("the request timed out in the queue")))
            return
        job.emit(Started(queue_s))
        started = time.perf_counter()
        handle, images = self.handle, job.conversation.images
        layout = self.layouts.build(job.conversation, add_generation_prompt=True)  # 1. what is new
        live, keep = self.pool.checkout(layout)  # 2. the longest matching prefix, computed once
        with live.dropped_on_error(), torch.inference_mode():
            sources = TurnSources(handle, self.kv_store, self.encoder_store, job.policy.reuse, self.pixels)
            logits, stats = run_turn(
                handle, live, layout, images, sources, job.policy, started, keep=keep
            )  # 3.
            ttft = time.perf_counter() - started
            job.emit(First(stats, ttft))
            decoder = Decoder(handle, live, logits, job.options, constraint=job.constraint,
                              should_stop=job.should_stop)  # fmt: skip
            for step in decoder:  # 4. the one decode loop
                job.emit(Delta(step))
        self.pool.checkin(live)  # 5.
        self.metrics.pool_entries.set(self.pool.num_entries)
        self.metrics.pool_bytes.set(self.pool.num_bytes)
        if decoder.finish_reason == "cancelled":
            return
        job.emit(Done(decoder.answer(stats, ttft, time.perf_counter() - started, queue_s)))
