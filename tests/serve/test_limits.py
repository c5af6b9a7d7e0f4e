"""What a server holds is bounded, whatever clients do: connections (number, headers' time, bodies' time), the
request deadline, memory for decoding images, the sizes of what is sent; and what it tells is behind its key.
Every check waits with a generous bound that only catches a hang: no assertion depends on how fast this
machine is."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading

import httpx
import numpy as np
import pytest
from PIL import Image

from mmkv.serve.budget import decode_bytes
from mmkv.serve.process import running

from .conftest import RunningServer, run_server, user

pytestmark = pytest.mark.server

HANG = 120.0  # seconds after which a wait is a hang (never the property tested)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` (reads until EOF or a reset; a hang bound only)."""
    sock.settimeout(HANG)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server with small connection and time bounds, and a key (health and metrics closed)."""
    with run_server(tmp_path_factory.mktemp("limits"), "--header-timeout", "1", "--body-timeout", "2",
                    "--keep-alive", "1", "--max-connections", "6", "--request-timeout", "60",
                    api_key="sekret") as server:  # fmt: skip
        yield server


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=HANG)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"G"])
def test_connections_without_complete_headers_are_closed(limited, sent):
    """A connection that sends nothing, half its headers, or one byte is closed by the server (after
    --header-timeout), not kept open."""
    sock = _connect(limited)
    sock.sendall(sent)
    assert _closed_by_server(sock)


def test_a_slowly_trickled_body_gets_408(limited):
    """A body still arriving after --body-timeout: 408, an OpenAI error object."""
    sock = _connect(limited)
    body = json.dumps({"model": "tiny-qwen3-vl", "messages": [{"role": "user", "content": "hi"}]}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])  # fmt: skip
    sock.settimeout(HANG)
    reply = b""
    while b"\r\n\r\n" not in reply or b"}}" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b'"timeout"' in reply


def test_connections_past_the_bound_are_closed_and_health_still_answers(limited):
    """More idle connections than --max-connections: the extra ones are closed at once, the rest after the
    header timeout, and then /health (with the key) answers: descriptors cannot be exhausted."""
    socks = [_connect(limited) for _ in range(20)]
    assert all(_closed_by_server(s) for s in socks)
    response = httpx.get(
        f"{limited.base_url}/health", headers={"Authorization": "Bearer sekret"}, timeout=HANG
    )
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_everything_needs_the_key_and_the_schema_docs_are_off(limited, path):
    """With --api-key: health, metrics and models answer 401 without it and 200 with it; /openapi.json and
    /docs do not exist."""
    assert httpx.get(f"{limited.base_url}{path}", timeout=HANG).status_code == 401
    ok = httpx.get(f"{limited.base_url}{path}", headers={"Authorization": "Bearer sekret"}, timeout=HANG)
    assert ok.status_code == 200
    for docs in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{limited.base_url}{docs}", timeout=HANG).status_code == 404


def test_open_health_and_metrics_by_flag(tmp_path):
    """--open-health / --open-metrics: those two answer without the key; chat still needs it."""
    with run_server(tmp_path, "--open-health", "--open-metrics", api_key="k") as server:
        assert httpx.get(f"{server.base_url}/health", timeout=HANG).status_code == 200
        assert httpx.get(f"{server.base_url}/metrics", timeout=HANG).status_code == 200
        assert httpx.get(f"{server.base_url}/v1/models", timeout=HANG).status_code == 401


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    if mode == "I;16":
        Image.fromarray(np.zeros((height, width), np.uint16)).save(buffer, "PNG")
    else:
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)).save(
            buffer, "PNG"
        )
    return buffer.getvalue()


def _data(png: bytes) -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
    }


def test_bounds_agree_a_big_valid_png_is_served_and_bigger_images_get_413(tmp_path):
    """Bounds agree with each other: a valid ~7 MiB PNG as a data: URL (past the old 8 MiB string cap once
    base64) is served under the default 20 MiB image bound; an image over the pixel bound, and one past
    Pillow's own bomb limit, are 413 with the server's message, never Pillow's."""
    with run_server(tmp_path, "--max-image-pixels", "4000000") as server:
        big = _png(1500, 1500)
        assert len(big) > 6 << 20
        body = {"model": "tiny-qwen3-vl", "messages": [user(_data(big), "What is it?")], "max_tokens": 1}
        assert server.post(body).status_code == 200
        for width, height in (
            (2100, 2000),
            (20000, 10000),
        ):  # over --max-image-pixels; past Pillow's bomb limit
            huge = _png(width, height, "I;16") if width < 20000 else _header_only_png(width, height)
            response = server.post(
                {"model": "tiny-qwen3-vl", "messages": [user(_data(huge), "?")], "max_tokens": 1}
            )
            assert response.status_code == 413, response.text
            message = response.json()["error"]["message"]
            assert "over the bound" in message and "decompression" not in message.lower()


def _header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (its pixel data is never reached: the bound is checked
    from the header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )




def test_decompression_heavy_images_wait_for_the_budget_and_are_answered(tmp_path):
    """Two requests at once, each an all-zero 16-bit PNG (a few KiB on the wire, tens of MB decoded), under a
    decode budget that fits one at a time: both are answered (the second waited), and one whose decode could
    never fit the budget is a 413."""
    png = _png(1800, 1800, "I;16")
    assert len(png) < 64 << 10
    need = decode_bytes(png, 64 << 20)
    (tmp_path / "fits").mkdir()
    (tmp_path / "small").mkdir()
    server, small = (RunningServer(["--model", "tiny-qwen3-vl", "--device", "cpu", "--decode-budget-bytes", str(budget)],
                                   tmp_path / name / "server.log")
                     for name, budget in (("fits", need + need // 2), ("small", need // 2)))  # fmt: skip
    with running([server, small]):  # both load at once
        results = []

        def ask(seed):
            body = {
                "model": "tiny-qwen3-vl",
                "messages": [user(_data(png), f"Image {seed}?")],
                "max_tokens": 1,
            }
            results.append(server.post(body).status_code)

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [200, 200]
        body = {"model": "tiny-qwen3-vl", "messages": [user(_data(png), "?")], "max_tokens": 1}
        response = small.post(body)
        assert response.status_code == 413 and "decode budget" in response.json()["error"]["message"]
