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
    monkeypatch.setattr(app_module, "_parsed", _recording(app_module._parsed, seen, "parse"))
    monkeypatch.setattr(engine, "intake", _recording(engine.intake, seen, "intake"))
    monkeypatch.setattr(engine, "prepare", _recording(engine.prepare, seen, "prepare"))
    with TestClient(create_app(engine)) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == status
    assert seen and seen[0][0] == "parse"
    assert [on_loop for _, on_loop, _ in seen] == [False] * len(seen), seen
    if status == 200:
        assert [name for name, _, _ in seen] == ["parse", "intake", "prepare"]
