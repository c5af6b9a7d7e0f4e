"""``Scheduler``: which requests wait, which one prefills, which decode, decided once per engine step.

It owns the waiting queue (FIFO, bounded: ``QueueFull`` past ``max_waiting``), the one request prefilling (its
prompt in chunks, between decode steps) and the running set (the decode batch's rows, in row order). Per step
(``schedule``) it drops waiting requests that were cancelled or ran out of time, and admits the head of the
queue when the prefill slot is free and the running set has room:

- at most ``max_batch`` requests prefilling or running (``max_batch=1``: one request at a time, in order of
  arrival, as a single-sequence server);
- the decode batch's KV within ``max_batch_kv_bytes``: rows are padded to the longest, so the bound is on
  ``rows x longest x bytes per token``, each request counted at its prompt plus its whole answer budget. A
  request alone is always admitted (it passed the prompt-length checks; nothing else would ever run it).

The queue is served in order: a head that does not fit waits, and nothing behind it overtakes it (no
starvation of long prompts). ``add`` and ``withdraw`` may be called from any thread; the rest only from the
engine's. Example::

    scheduler = Scheduler(EngineConfig(max_batch=2), kv_bytes_per_token=1024)
    scheduler.add(a); scheduler.add(b); scheduler.add(c)
    scheduler.schedule().admitted is a        # a prefills
    scheduler.prefilled(a)                    # a runs
    scheduler.schedule().admitted is b        # b prefills while a decodes
    scheduler.prefilled(b)
    scheduler.schedule().admitted is None     # c waits: two are running
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ..config import check_int
from .request import Request, Status

__all__ = ["EngineConfig", "QueueFull", "Scheduler", "StepPlan"]


class QueueFull(Exception):
    """The queue holds ``max_waiting`` waiting requests already."""


@dataclass(frozen=True)
class EngineConfig:
    """How much the engine runs at once. Validated on construction."""

    max_batch: int = 8  # requests prefilling or decoding at once (1: one at a time)
    max_batch_kv_bytes: int = 2 << 30  # bound on the padded decode batch's KV (see the module docstring)
    prefill_chunk: int | None = 512  # computed tokens per prefill forward call (None: no bound)
    max_waiting: int = 16  # requests queued beyond those admitted; more: QueueFull

    def __post_init__(self) -> None:
        check_int(self.max_batch, "max_batch", 1)
        check_int(self.max_batch_kv_bytes, "max_batch_kv_bytes", 1)
        check_int(self.max_waiting, "max_waiting", 0)
        if self.prefill_chunk is not None:
            check_int(self.prefill_chunk, "prefill_chunk", 16)


@dataclass(frozen=True)
class StepPlan:
    """What one engine step does."""

    dropped: tuple[Request, ...]  # waiting requests that leave now (cancelled, or past their deadline)
    admitted: Request | None  # the request whose prefill starts this step
    prefill: Request | None  # the request prefilling this step (one chunk)
    decode: tuple[Request, ...]  # the running requests, in batch row order: one token each


class Scheduler:
    """Waiting, prefilling and running requests (see the module docstring)."""

    def __init__(self, config: EngineConfig, kv_bytes_per_token: int) -> None:
        self.config = config
        self.kv_bytes_per_token = kv_bytes_per_token
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()  # guards _waiting (add / withdraw come from other threads)
        self.prefilling: Request | None = None
        self.running: list[Request] = []

    # ------------------------------------------------------------------------------- any thread
    def add(self, request: Request) -> None:
        """Queue ``request``; ``QueueFull`` (nothing queued) when ``max_waiting`` wait already."""
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise QueueFull
            self._waiting.append(request)

    def withdraw(self, request: Request) -> bool:
        """Cancel ``request``; a waiting one leaves the queue at once (True), an admitted one at the next step."""
        request.cancel()
        with self._lock:
            try:
                self._waiting.remove(request)
            except ValueError:
                return False
        request.status = Status.FINISHED
        return True

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self._waiting or self.prefilling is not None or self.running)

    # ---------------------------------------------------------------------------- engine thread
    def schedule(self) -> StepPlan:
        """This step's plan; admitting a request moves it to PREFILLING. Dropped requests are FINISHED."""
        dropped, admitted = [], None
        with self._lock:
            for request in [r for r in self._waiting if r.should_stop()]:
                self._waiting.remove(request)
                request.status = Status.FINISHED
                dropped.append(request)
            if self.prefilling is None and self._waiting and self._fits(self._waiting[0]):
                admitted = self.prefilling = self._waiting.popleft()
                admitted.status = Status.PREFILLING
        return StepPlan(tuple(dropped), admitted, self.prefilling, tuple(self.running))

    def prefilled(self, request: Request) -> None:
        """``request``'s prompt is in: it joins the running set (the batch's last row)."""
        assert request is self.prefilling, "not the request prefilling"
        self.prefilling = None
        request.status = Status.RUNNING
        self.running.append(request)

    def finish(self, request: Request) -> None:
        """``request`` leaves the engine (answered, cancelled or failed)."""
        if request is self.prefilling:
            self.prefilling = None
        elif request in self.running:
            self.running.remove(request)
        request.status = Status.FINISHED

    def _fits(self, request: Request) -> bool:
        """Whether admitting ``request`` keeps the batch within ``max_batch`` and its KV bound."""
        if not self.running:
            return True
        if len(self.running) + 1 > self.config.max_batch:
            return False
        longest = max(r.kv_tokens() for r in (*self.running, request))
        padded = (len(self.running) + 1) * longest * self.kv_bytes_per_token
        return padded <= self.config.max_batch_kv_bytes
