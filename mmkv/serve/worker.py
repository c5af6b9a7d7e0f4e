"""The model worker: one thread that runs requests one at a time, in order of arrival, from a bounded queue.

Why one worker: the model runs on one device and mmkv's turns build per-sequence ``DynamicCache`` s spliced
at arbitrary positions; running requests one at a time keeps each answer exactly what a ``Session`` would give
and memory predictable. Continuous batching would need paged KV (a request's cache as pages that splices can
point into), a scheduler interleaving prefill chunks with decode steps, and batched M-RoPE positions and
masks over sequences of different lengths: a different engine (vLLM's), which mmkv's records could feed.

A ``Job`` carries a request's conversation and settings in, and its events out (to the request's asyncio
queue, via the event loop): ``("started", queue_s)``, ``("first", stats, ttft_s)``, ``("text", delta)``,
``("done", Completion)`` or ``("error", status, message, kind)``. A job cancelled while queued (its client
went away) leaves the queue at once; one cancelled or past its deadline while decoding stops at the next token.
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
from ..errors import MmkvError
from ..model.handle import ModelHandle
from ..prompt.blocks import LayoutBuilder
from ..runtime import Sampling, TurnPolicy, TurnSources, generate, run_turn
from ..runtime.decode import AnswerText, end_of_turn_id
from ..runtime.report import PrefillStats
from .metrics import Metrics
from .pool import LivePool

__all__ = ["Completion", "Job", "QueueFull", "Worker"]


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


@dataclass
class Job:
    """One request's work and the channel its events go back on."""

    conversation: Conversation
    policy: TurnPolicy
    sampling: Sampling
    max_tokens: int
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    deadline: float  # time.monotonic() after which the job is abandoned
    submitted: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, *event) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass(frozen=True)
class Completion:
    """What a finished job produced."""

    text: str  # the answer, special tokens removed, stripped (as Session.ask)
    token_ids: tuple[int, ...]  # generated ids
    finish_reason: str  # "stop" (end of turn or a stop string) or "length"
    stats: PrefillStats  # the prefill
    ttft_s: float
    queue_s: float


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
    ) -> None:
        self.handle, self.kv_store, self.encoder_store, self.pixels = handle, kv_store, encoder_store, pixels
        self.pool, self.metrics = pool, metrics
        self.queue = _JobQueue(max_queue)
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
            except MmkvError as exc:
                job.emit("error", 400, str(exc), "invalid_request_error")
            except Exception as exc:  # a bug: answer with an error object, keep serving
                job.emit("error", 500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def _run(self, job: Job) -> None:
        queue_s = time.monotonic() - job.submitted
        self.metrics.queue_wait.observe(queue_s)
        job.emit("started", queue_s)
        started = time.perf_counter()
        conversation, handle = job.conversation, self.handle
        layout = LayoutBuilder(handle).build(conversation, add_generation_prompt=True)
        live, _ = self.pool.checkout(layout)
        with live.dropped_on_error(), torch.inference_mode():
            sources = TurnSources(handle, self.kv_store, self.encoder_store, job.policy.reuse, self.pixels)
            logits, stats = run_turn(handle, live, layout, conversation.images, sources, job.policy, started)
            ttft = time.perf_counter() - started
            job.emit("first", stats, ttft)
            text, tokens, finish = (
                AnswerText(handle.tokenizer, job.stops, lambda d: job.emit("text", d)),
                [],
                "length",
            )
            budget = max(1, min(job.max_tokens, handle.max_positions - live.next_position + 1))
            eos = end_of_turn_id(handle)
            for token in generate(handle, live, logits, budget, job.sampling):
                if job.cancelled.is_set() or time.monotonic() > job.deadline:
                    finish = "cancelled"
                    break
                tokens.append(token)
                if token == eos or text.add(tokens):
                    finish = "stop"
                    break
        if finish == "cancelled":
            self.pool.checkin(live)
            return
        self.pool.checkin(live)
        self.metrics.pool_entries.set(self.pool.num_entries)
        self.metrics.pool_bytes.set(self.pool.num_bytes)
        job.emit("done", Completion(text.finish(), tuple(tokens), finish, stats, ttft, queue_s))
