"""DeadlineTransport over real sockets: every operation cut to one deadline, connections only to checked
addresses (a local server stands in for a media host)."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import httpcore
import httpx
import pytest

from mmkv.serve import http_client
from mmkv.serve.http_client import DeadlineTransport, _DeadlineStream


class LocalHost:
    """A one-connection-at-a-time HTTP server on 127.0.0.1 whose reply ``serve(conn)`` writes; records
    connections."""

    def __init__(self, serve) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.serve, self.connections, self.stop = serve, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.listener.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.recv(65536)
                try:
                    self.serve(conn, self.stop)
                except OSError:
                    pass  # the client hung up

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()


def _client(deadline: float, addresses) -> httpx.Client:
    transport = DeadlineTransport(deadline, addresses, httpx.create_ssl_context())
    return httpx.Client(transport=transport, timeout=60, trust_env=False)


def test_a_normal_reply_comes_through_from_the_checked_address():
    """The host name never resolves; the transport connects to the address the check returned, and the body
    arrives intact."""

    def serve(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello")

    host, asked = LocalHost(serve), []
    try:

        def addresses(name, port):
            asked.append((name, port))
            return ["127.0.0.1"]

        with _client(time.monotonic() + 60, addresses) as client:
            reply = client.get(f"http://images.invalid:{host.port}/a.png")
        assert reply.status_code == 200 and reply.content == b"hello"
        assert asked == [("images.invalid", host.port)] and host.connections == 1
    finally:
        host.close()


def test_a_trickling_body_ends_at_the_deadline():
    """A host sending one byte every 20 ms forever (each read returns quickly): the transport raises a timeout
    once the one deadline has passed, whatever the per-operation timeout says."""

    def serve(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n")
        while not stop.wait(0.02):
            conn.sendall(b"x")

    host = LocalHost(serve)
    try:
        with _client(time.monotonic() + 0.3, lambda name, port: ["127.0.0.1"]) as client:
            with pytest.raises((httpcore.TimeoutException, httpx.TimeoutException)):
                with client.stream("GET", f"http://images.invalid:{host.port}/") as reply:
                    for _ in reply.iter_raw():
                        pass
    finally:
        host.close()


def test_a_refused_address_check_makes_no_connection():
    """When the address check raises, no connection is attempted and its exception reaches the caller."""
    host = LocalHost(lambda conn, stop: None)

    def refuse(name, port):
        raise PermissionError(f"{name} resolves to a private address")

    try:
        with _client(time.monotonic() + 60, refuse) as client:
            with pytest.raises(PermissionError, match="private address"):
                client.get(f"http://images.invalid:{host.port}/")
        assert host.connections == 0
    finally:
        host.close()


class _Recorder(httpcore.NetworkStream):
    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def read(self, max_bytes, timeout=None):
        self.timeouts.append(timeout)
        return b"x"

    def write(self, buffer, timeout=None):
        self.timeouts.append(timeout)


def test_each_operation_gets_at_most_what_is_left(monkeypatch):
    """Reads and writes get min(their timeout, time left) on a fake clock; past the deadline nothing reaches
    the socket."""
    now = [1000.0]
    monkeypatch.setattr(http_client, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep))
    inner = _Recorder()
    stream = _DeadlineStream(inner, 1005.0)
    stream.read(10, timeout=60)
    now[0] = 1002.0
    stream.write(b"x", timeout=None)
    stream.read(10, timeout=0.5)
    assert inner.timeouts == [5.0, 3.0, 0.5]
    late = _DeadlineStream(inner, 999.0)
    with pytest.raises(httpcore.ReadTimeout):
        late.read(10, timeout=60)
    with pytest.raises(httpcore.WriteTimeout):
        late.write(b"x", timeout=60)
    assert len(inner.timeouts) == 3
