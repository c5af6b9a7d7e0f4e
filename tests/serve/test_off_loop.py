"""Nothing input-sized runs on the event loop: a request body's depth check, JSON parse and validation, its intake
(images, conversation) and its layout each run on a worker thread, for bodies of every outcome (answered,
refused as invalid, refused as too deep, refused for its model)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from starlette.testclient import TestClient

from mmkv.serve import Engine, ServerConfig
from mmkv.serve import app as app_module
from mmkv.serve.app import create_app


@pytest.fixture(scope="module")
def engine():
    engine = Engine(ServerConfig(model="tiny-qwen3-vl", device="cpu"))
    yield engine
    engine.close()


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _recording(function, seen: list, name: str):
    def wrapper(*args, **kwargs):
        seen.append((name, _on_loop(), threading.current_thread().name))
        return function(*args, **kwargs)

    return wrapper


DEEP: list = []
for _ in range(70):
    DEEP = [DEEP]  # nested past the 64-level bound
GOOD = {"model": "tiny-qwen3-vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "body, status",
    [
        (GOOD, 200),
        ({**GOOD, "messages": "not a list"}, 400),
        ({**GOOD, "metadata": DEEP}, 400),
        ({**GOOD, "model": "nope"}, 404),
        ({**GOOD, "messages": [{"role": "user", "content": "x " * 200_000}]}, 400),
    ],
    ids=["answered", "invalid", "too-deep", "unknown-model", "long-text"],
)
def test_body_work_runs_off_the_event_loop(engine, monkeypatch, body, status):
    seen: list = []
    monkeypatch.setattr(app_module, "_shape", _recording(app_module._shape, seen, "shape"))
    monkeypatch.setattr(app_module, "_parsed", _recording(app_module._parsed, seen, "parse"))
    monkeypatch.setattr(engine, "intake", _recording(engine.intake, seen, "intake"))
    monkeypatch.setattr(engine, "prepare", _recording(engine.prepare, seen, "prepare"))
    with TestClient(create_app(engine)) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == status
    assert [name for name, _, _ in seen][:2] == (["shape"] if status == 400 and body.get("metadata") else
                                                 ["shape", "parse"])  # fmt: skip
    assert [on_loop for _, on_loop, _ in seen] == [False] * len(seen), seen
    if status == 200:
        assert [name for name, _, _ in seen] == ["shape", "parse", "intake", "prepare"]


def _schema_body(nodes: int, model: str = "tiny-qwen3-vl") -> dict:
    """A chat body whose response_format schema holds ``nodes`` objects (past HEAVY_BODY_BRACKETS: heavy)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(nodes)}}
    return {**GOOD, "model": model, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                               "schema": schema}}}  # fmt: skip


@pytest.mark.parametrize(
    "light", [GOOD | {"model": "nope"}, _schema_body(10, model="nope")], ids=["plain", "schema"]
)
def test_heavy_bodies_are_parsed_one_at_a_time_and_light_ones_never_wait(light, monkeypatch):
    """While one body of more than HEAVY_BODY_BRACKETS objects is being parsed (held inside ``_parsed``), a light
    body is parsed and answered (its 404 names the model), and a second heavy one waits for the turn without
    entering ``_parsed`` until its deadline: 504 saying why. Released, the first is answered as usual."""
    engine = Engine(ServerConfig(model="tiny-qwen3-vl", device="cpu", request_timeout_s=3.0))
    inside, release, entered = threading.Event(), threading.Event(), []
    parsed = app_module._parsed

    def held(data, names):
        entered.append(len(data))
        if len(entered) == 1:
            inside.set()
            assert release.wait(60)  # a bound for a test that never releases, not a measurement
        return parsed(data, names)

    monkeypatch.setattr(app_module, "_parsed", held)
    heavy = _schema_body(app_module.HEAVY_BODY_BRACKETS + 10, model="nope")
    try:
        with TestClient(create_app(engine)) as client:
            first: list = []
            thread = threading.Thread(
                target=lambda: first.append(client.post("/v1/chat/completions", json=heavy))
            )
            thread.start()
            assert inside.wait(60)
            reply = client.post("/v1/chat/completions", json=light)
            assert reply.status_code == 404 and "'nope' does not exist" in reply.json()["error"]["message"]
            second = client.post("/v1/chat/completions", json=heavy)
            assert second.status_code == 504
            assert "waited for other large JSON bodies" in second.json()["error"]["message"]
            assert len(entered) == 2  # the first heavy one and the light one; never the second heavy one
            release.set()
            thread.join()
            assert first[0].status_code == 404
    finally:
        release.set()
        engine.close()
