"""Connections a server keeps open are bounded in number and in time, before any request reaches the app.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but nothing bounds a connection
that sends its request headers a byte at a time (or never sends them), and it answers 503 to connections past
``limit_concurrency`` only once their headers are in: slow or idle clients can hold file descriptors until none
are left. ``guarded_protocol`` makes uvicorn's own HTTP protocol class (subclassed, not re-implemented) close

- a connection opened while ``max_connections`` are open, at once;
- a connection whose request headers are not complete ``header_timeout_s`` after its first byte of a request
  (or after it opened), whether it sends nothing or a trickle.

Bodies are bounded in the app (``body_timeout_s`` and the request's deadline). Example::

    uvicorn.run(app, http=guarded_protocol(header_timeout_s=10, max_connections=512), timeout_keep_alive=5)
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["guarded_protocol"]

log = logging.getLogger("mmkv.serve")


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the two bounds above (a class to pass as ``uvicorn.run(..., http=...)``)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refused a connection: %d open (--max-connections %d)", len(self.connections) - 1,
                            max_connections)  # fmt: skip
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of a next request: its headers are due in time too
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the headers are in: the app bounds the body

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

    return GuardedH11Protocol
