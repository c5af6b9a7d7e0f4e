"""Graceful drain (``mmkv.serve.drain``): on SIGTERM a replica refuses new requests with a 503 error object and
``Retry-After``, ``/health`` turns 503 "draining", the requests it holds are answered in full, then it exits 0.
A gateway reads exactly these to take a replica out of rotation without cutting an answer."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from mmkv.model.families.qwen_vl import QWEN_SPECIAL_TOKENS
from mmkv.serve.drain import Drain
from tests.serve.conftest import run_server, user

pytestmark = pytest.mark.server
END_OF_TURN = str(QWEN_SPECIAL_TOKENS.index("<|im_end|>"))  # the tiny tokenizers put special tokens first


def test_admit_refuses_only_after_begin_and_counts_what_it_admitted():
    drain = Drain()
    assert drain.admit() and drain.admit() and drain.arriving == 2
    drain.release()
    drain.begin()
    assert not drain.admit() and drain.arriving == 1  # a refusal is not counted
    drain.begin()  # idempotent
    assert drain.draining and not drain.admit()
    drain.release()
    assert drain.arriving == 0


def test_wait_idle_waits_for_arrivals_and_the_worker():
    drain = Drain()
    polls = iter([True, True, True, False])
    assert drain.wait_idle(lambda: next(polls), timeout_s=60)  # idle on the 4th look, whatever the clock
    assert not drain.wait_idle(lambda: True, timeout_s=0)  # never idle: the timeout
    drain.admit()
    assert not drain.wait_idle(lambda: False, timeout_s=0)  # one still arriving
    drain.release()
    assert drain.wait_idle(lambda: False, timeout_s=0)


def _long_stream(server, received: list[str], started: threading.Event) -> None:
    """A streamed answer of 300 tokens (the end of turn biased away): held by the server for seconds."""
    body = {"model": "tiny-qwen3-vl", "messages": [user("count")], "max_tokens": 300, "stream": True,
            "logit_bias": {END_OF_TURN: -100, "0": -100}}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line:
                received.append(line)
                started.set()


def test_sigterm_drains_refuses_new_requests_and_finishes_the_ones_held(tmp_path):
    with run_server(tmp_path, "--drain-timeout", "600", process=True) as server:
        received: list[str] = []
        started = threading.Event()
        reader = threading.Thread(target=_long_stream, args=(server, received, started))
        reader.start()
        assert started.wait(120), "the stream never started"
        assert server.get("/health").status_code == 200
        server.process.send_signal(signal.SIGTERM)
        health = server.get("/health")
        refused = server.post({"model": "tiny-qwen3-vl", "messages": [user("hi")], "max_tokens": 4})
        reader.join(300)
        code = server.process.wait(120)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert health.headers["retry-after"] == "1" and health.json()["running"] == 1
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "draining" and error["type"] == "server_busy" and "draining" in error["message"]
    assert received[-1] == "data: [DONE]"  # the held answer came whole, to its length
    chunks = [json.loads(line[6:]) for line in received[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks) > 50
    assert code == 0
    log = (tmp_path / "server.log").read_text()
    assert "SIGTERM: draining" in log and "drained: every request held was answered" in log


def test_an_idle_server_exits_at_once_on_sigterm(tmp_path):
    with run_server(tmp_path, process=True) as server:
        assert (
            server.post({"model": "tiny-qwen3-vl", "messages": [user("hi")], "max_tokens": 2}).status_code
            == 200
        )
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(120) == 0
    assert "drained" in (tmp_path / "server.log").read_text()


def test_a_draining_app_refuses_every_chat_request_and_queues_none():
    """In process: once draining, every form of chat request (plain, streamed, invalid, with tools) is the same
    503 error object before its body is read, ``/health`` is 503, and other routes still answer."""
    from starlette.testclient import TestClient

    from mmkv.serve import Engine, ServerConfig
    from mmkv.serve.app import create_app

    engine = Engine(ServerConfig(model="tiny-qwen3-vl", device="cpu"))
    plain = {"model": "tiny-qwen3-vl", "messages": [user("hi")], "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bodies = [plain, {**plain, "stream": True}, {**plain, "messages": "nope"}, {**plain, "tools": [tool]}]
    with TestClient(create_app(engine)) as client:
        assert client.post("/v1/chat/completions", json=plain).status_code == 200
        assert client.get("/health").json()["status"] == "ok"
        engine.drain.begin()
        replies = [client.post("/v1/chat/completions", json=body) for body in bodies]
        health = client.get("/health")
        models = client.get("/v1/models")
    engine.close()
    assert {r.status_code for r in replies} == {503}
    assert {r.json()["error"]["code"] for r in replies} == {"draining"}
    assert {r.headers["retry-after"] for r in replies} == {"1"}
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert models.status_code == 200
    assert engine.drain.arriving == 0 and not engine.busy()
