"""Graceful drain: what a replica behind a gateway does when it is told to go away.

On the first SIGTERM the server starts draining: ``/health`` answers 503 ``{"status": "draining"}`` (a gateway's
health check takes the replica out of rotation), a new chat request gets a 503 error object with
``Retry-After`` (a gateway retries it on another replica; a direct client sees why), and every request it
already holds (being read, queued, prefilling, decoding, streaming) is answered in full. Once none is left, or
``drain_timeout_s`` has passed, uvicorn's own shutdown runs (it closes idle connections and waits for open
responses to end). A second SIGTERM, or SIGINT, exits at once, as plain uvicorn does.

    drain = Drain()
    if not drain.admit():        # (the route, first thing) -> 503 "draining"
        ...
    try: ...                     # read, intake, submit to the worker
    finally: drain.release()
    # the worker holds it from here on: idle() asks the worker too

Nothing here changes a request that arrives while the server is not draining.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

__all__ = ["Drain", "DrainingServer"]

log = logging.getLogger("mmkv.serve")
POLL_S = 0.05  # how often the drain looks whether the server is idle


class Drain:
    """Whether the server is draining, and how many requests are between arrival and the worker's queue."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arriving = 0  # admitted, not yet handed to the worker (or refused)
        self.draining = False

    def admit(self) -> bool:
        """Count a new request in, or return False (the server is draining: refuse it). Pair with ``release``."""
        with self._lock:
            if self.draining:
                return False
            self._arriving += 1
            return True

    def release(self) -> None:
        """The request admitted last by this caller was handed to the worker, or answered."""
        with self._lock:
            self._arriving -= 1

    def begin(self) -> None:
        """Start draining: from now on ``admit`` refuses. Idempotent; never undone."""
        with self._lock:
            self.draining = True

    @property
    def arriving(self) -> int:
        return self._arriving

    def wait_idle(self, busy: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until no request is arriving and ``busy()`` (the worker's queue and batch) is false, at most
        ``timeout_s``; True if the server went idle. Polls; changes nothing."""
        end = time.monotonic() + timeout_s
        while self._arriving or busy():
            if time.monotonic() >= end:
                return False
            time.sleep(POLL_S)
        return True


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the first SIGTERM a drain (above) instead of an immediate shutdown."""

    def __init__(
        self, config: uvicorn.Config, drain: Drain, busy: Callable[[], bool], timeout_s: float
    ) -> None:
        super().__init__(config)
        self.drain, self.busy, self.timeout_s = drain, busy, timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining:
            self.drain.begin()
            log.info(
                "SIGTERM: draining (new requests get 503; at most %.0f s for the ones held)", self.timeout_s
            )
            threading.Thread(target=self._exit_when_idle, name="mmkv-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _exit_when_idle(self) -> None:
        if self.drain.wait_idle(self.busy, self.timeout_s):
            log.info("drained: every request held was answered; shutting down")
        else:
            log.warning("drain timeout (%.0f s) with requests still held; shutting down", self.timeout_s)
        self.should_exit = True  # uvicorn's main loop looks at this every tick
