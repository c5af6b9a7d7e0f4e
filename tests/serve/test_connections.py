"""guarded_protocol, on uvicorn's own h11 protocol and a loop driven step by step (no sockets, no clocks):
a connection past the bound is closed at once, one whose headers are not complete when its timer fires is
closed (nothing sent, or a trickle), one whose headers arrived is left to the app, and a lost connection
leaves no timer behind."""

from __future__ import annotations

import asyncio

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from mmkv.serve.connections import guarded_protocol


class _Transport(asyncio.Transport):
    """Just what the protocol asks of a transport; records writes and whether it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed, self.written = False, b""

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def write(self, data) -> None:
        self.written += bytes(data)

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


async def _never_answers(scope, receive, send):
    await asyncio.Event().wait()


async def _turns(n: int) -> None:
    """Let the loop run ``n`` iterations (a timer due now fires within one)."""
    for _ in range(n):
        await asyncio.sleep(0)


def _open(protocol_class, state: ServerState):
    config = Config(app=_never_answers, lifespan="off", log_level="warning")
    protocol, transport = protocol_class(config, state, {}), _Transport()
    protocol.connection_made(transport)
    return protocol, transport


@pytest.mark.parametrize("sent", [b"", b"G", b"GET / HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_complete_headers_is_closed_when_its_timer_fires(sent):
    async def scenario():
        protocol, transport = _open(guarded_protocol(header_timeout_s=0, max_connections=8), ServerState())
        if sent:
            protocol.data_received(sent)
        await _turns(3)
        return transport.closed

    assert asyncio.run(scenario())


def test_complete_headers_disarm_the_timer_and_the_app_bounds_the_body():
    async def scenario():
        protocol, transport = _open(guarded_protocol(header_timeout_s=0, max_connections=8), ServerState())
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await _turns(3)
        closed, timer = transport.closed, protocol._header_timer
        protocol.connection_lost(None)
        return closed, timer

    assert asyncio.run(scenario()) == (False, None)


def test_connections_past_the_bound_are_closed_at_once_and_the_rest_kept():
    async def scenario():
        guarded, state = guarded_protocol(header_timeout_s=3600, max_connections=2), ServerState()
        opened = [_open(guarded, state) for _ in range(4)]
        closed = [transport.closed for _, transport in opened]
        for protocol, _ in opened:
            protocol.connection_lost(None)
        return closed, [protocol._header_timer for protocol, _ in opened], len(state.connections)

    closed, timers, left = asyncio.run(scenario())
    assert closed == [False, False, True, True] and timers == [None] * 4 and left == 0
