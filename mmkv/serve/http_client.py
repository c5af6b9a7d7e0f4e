"""An httpx transport for image fetches: one absolute deadline over every step, connections to checked addresses.

httpx's timeouts are per operation (a host sending one byte every few seconds never trips a read timeout), and
its connection resolves the host again after any check the caller made. ``DeadlineTransport`` fixes both below
httpx, in httpcore's public network-backend interface:

- every connect, TLS handshake, read and write gets ``min(its own timeout, deadline - now)``, and none starts
  once the deadline has passed (``httpcore.ReadTimeout`` / ``ConnectTimeout``);
- a TCP connection goes only to an address that ``addresses(host, port)`` returned (the caller's check, e.g.
  "every address is public"), never to a second lookup's answer; TLS still verifies the host name.

It knows nothing about images or allow-lists; ``mmkv.serve.media`` supplies the check and maps the errors.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterator

import httpcore
import httpx

__all__ = ["DeadlineTransport"]

AddressCheck = Callable[
    [str, int], list[str]
]  # (host, port) -> addresses it may connect to; raises to refuse


def _left(deadline: float, timeout: float | None, error: type[Exception]) -> float:
    """Seconds an operation may take: its own ``timeout`` cut to what is left before ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the fetch's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every read, write and TLS handshake ends by ``deadline``."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self._inner, self._deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(self._deadline, timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(self._deadline, timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        left = _left(self._deadline, timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, left), self._deadline)

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _CheckedBackend(httpcore.NetworkBackend):
    """Connects to the addresses ``addresses`` approved, by ``deadline``; no UNIX sockets."""

    def __init__(
        self, deadline: float, addresses: AddressCheck, inner: httpcore.NetworkBackend | None = None
    ):
        self._deadline, self._addresses = deadline, addresses
        self._inner = inner or httpcore.SyncBackend()

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        failure: Exception | None = None
        for address in self._addresses(host, port):
            left = _left(self._deadline, timeout, httpcore.ConnectTimeout)
            try:
                stream = self._inner.connect_tcp(address, port, left, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
                continue
            return _DeadlineStream(stream, self._deadline)
        raise failure or httpcore.ConnectError(f"no address to connect to for {host!r}")

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.ConnectError("image fetches never use UNIX sockets")

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, max(0.0, self._deadline - time.monotonic())))


class _Body(httpx.SyncByteStream):
    def __init__(self, stream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        yield from self._stream

    def close(self) -> None:
        if hasattr(self._stream, "close"):
            self._stream.close()


class DeadlineTransport(httpx.BaseTransport):
    """httpx transport over an httpcore pool whose backend enforces ``deadline`` (``time.monotonic()`` based)
    and connects only to checked addresses (see the module docstring). Errors are httpcore's own exceptions
    (or whatever ``addresses`` raises), unmapped: the caller turns every one into its own error."""

    def __init__(self, deadline: float, addresses: AddressCheck, ssl_context: ssl.SSLContext) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context, max_connections=2, network_backend=_CheckedBackend(deadline, addresses)
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = httpcore.URL(
            scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
            target=request.url.raw_path,
        )  # fmt: skip
        response = self._pool.handle_request(
            httpcore.Request(
                request.method,
                url,
                headers=request.headers.raw,
                content=request.stream,
                extensions=request.extensions,
            )  # fmt: skip
        )
        return httpx.Response(
            response.status, headers=response.headers, stream=_Body(response.stream),
            extensions=response.extensions,
        )  # fmt: skip

    def close(self) -> None:
        self._pool.close()
