"""Many agents at once through a real ``mmkv serve`` (tiny-qwen3-vl): eight concurrent clients mixing tools,
``json_schema``, logprobs, streaming, screenshots spliced at shifted positions and a sliding window, with one
client that disconnects mid-stream, get from the batching engine the answers a ``--max-batch 1`` server gives
them one at a time."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from .conftest import image_part, run_server, user

pytestmark = pytest.mark.server

MODEL = "tiny-qwen3-vl"
CLICK = {"type": "function", "function": {"name": "click", "description": "Click a button.", "parameters": {
    "type": "object", "properties": {"target": {"type": "string", "enum": ["approve", "submit", "back"]}},
    "required": ["target"]}}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["ok", "broken"]},
          "count": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["verdict", "count"]}  # fmt: skip


def _turns(k: int):
    """Agent ``k``'s three requests: its history resent each turn, a new screenshot per turn, the last two
    kept (the window slides, so kept screenshots move), screenshot 0 shared by every agent."""
    history = [{"role": "system", "content": "You operate a desktop." + " Be careful." * k}]
    shots = []
    for turn in range(3):
        shots.append(0 if turn == 0 else 100 * k + turn)
        messages = list(history)
        for i, seed in enumerate(shots):
            parts = [{"type": "text", "text": f"Screen {i}."}]
            if i >= len(shots) - 2:
                parts.append(image_part(seed))
            messages.append(user(*parts))
            if i < len(shots) - 1:
                messages.append({"role": "assistant", "content": f"Looked at screen {i}."})
        body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 10 + 2 * k}
        if k % 4 == 1:
            body |= {"tools": [CLICK], "tool_choice": "required", "max_tokens": 64}
        elif k % 4 == 2:
            body |= {
                "max_tokens": 64,
                "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}},
            }
        elif k % 4 == 3:
            body |= {"logprobs": True, "top_logprobs": 2}
        if k % 2 == 0:
            body |= {"stream": True}
        yield body


def _send(base_url: str, body: dict) -> dict:
    """The answer as comparable data: content, tool calls (name, arguments), logprobs, finish reason."""
    url = f"{base_url}/v1/chat/completions"
    if not body.get("stream"):
        choice = httpx.post(url, json=body, timeout=300).raise_for_status().json()["choices"][0]
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []
        ]
        logprobs = [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
        return {"content": choice["message"]["content"], "calls": calls, "logprobs": logprobs,
                "finish": choice["finish_reason"]}  # fmt: skip
    content, finish = [], None
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                content.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    return {"content": "".join(content), "calls": [], "logprobs": [], "finish": finish}


def _agent(base_url: str, k: int, out: list) -> None:
    for body in _turns(k):
        out.append(_send(base_url, body))


def _leaver(base_url: str, started: threading.Event) -> None:
    """A client that reads two events of a long stream and goes away."""
    body = {"model": MODEL, "messages": [user(image_part(0), "Tell a long story.")], "max_tokens": 2000,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n >= 2:
                break
    started.set()


def _warm(base_url: str) -> None:
    """Every screenshot the agents send, once, in one order: its KV is in the store before the agents run, so in
    both runs each is spliced from the same record (re-rotated to wherever it lands); which agent computed it
    first cannot depend on timing."""
    for seed in [0] + [100 * k + t for k in range(8) for t in (1, 2)]:
        body = {"model": MODEL, "messages": [user(image_part(seed), "Warm.")], "max_tokens": 1}
        httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def _same(batched: dict, serial: dict) -> None:
    assert {k: v for k, v in batched.items() if k != "logprobs"} == {
        k: v for k, v in serial.items() if k != "logprobs"
    }
    assert len(batched["logprobs"]) == len(serial["logprobs"])
    assert all(abs(a - b) < 1e-4 for a, b in zip(batched["logprobs"], serial["logprobs"], strict=True))


def test_eight_concurrent_agents_get_the_answers_of_one_at_a_time(tmp_path):
    """Serial on a --max-batch 1 server, concurrent on a batching one (plus a client leaving mid-stream): every
    answer equal (tokens, tool calls, JSON, finish reasons; logprobs within 1e-4), and the batching server did
    run several requests in one decode forward (its metrics say so)."""
    (tmp_path / "serial").mkdir()
    (tmp_path / "batched").mkdir()
    with run_server(tmp_path / "serial", "--max-batch", "1") as one:
        _warm(one.base_url)
        serial = {k: [] for k in range(8)}
        for k in range(8):
            _agent(one.base_url, k, serial[k])
    with run_server(tmp_path / "batched", "--max-batch", "8") as many:
        _warm(many.base_url)
        batched = {k: [] for k in range(8)}
        left = threading.Event()
        threads = [threading.Thread(target=_leaver, args=(many.base_url, left))]
        threads += [threading.Thread(target=_agent, args=(many.base_url, k, batched[k])) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        metrics = many.get("/metrics").text
        health = many.get("/health").json()
    assert left.is_set()
    for k in range(8):
        assert len(batched[k]) == 3
        for b, s in zip(batched[k], serial[k], strict=True):
            _same(b, s)
        if k % 4 == 2:
            assert all(json.loads(a["content"])["verdict"] in ("ok", "broken") for a in batched[k])
        if k % 4 == 1:
            assert all(a["calls"] and a["calls"][0][0] == "click" for a in batched[k])
    batch_line = next(line for line in metrics.splitlines() if line.startswith("mmkv_decode_batch_rows_sum"))
    count_line = next(
        line for line in metrics.splitlines() if line.startswith("mmkv_decode_batch_rows_count")
    )
    assert float(batch_line.split()[-1]) / float(count_line.split()[-1]) > 1.5  # rows per decode forward
    assert health["running"] == 0 and health["queue"] == 0


def test_a_departed_non_streamed_client_stops_its_work(tmp_path):
    """A non-streamed request for 1500 tokens whose client gives up after a second leaves the engine at its next
    step: the server runs far fewer than 1500 decode forwards for it, and a later request is answered."""
    (tmp_path / "s").mkdir()
    with run_server(tmp_path / "s", "--max-batch", "1") as server:
        body = {
            "model": MODEL,
            "messages": [user("Tell a long story.")],
            "max_tokens": 1500,
            "temperature": 0,
        }
        try:
            httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=1.0)
        except httpx.TimeoutException:
            pass
        for _ in range(2400):  # the bound only catches a hang
            if server.get("/health").json()["running"] == 0:
                break
            threading.Event().wait(0.05)
        later = _send(server.base_url, {"model": MODEL, "messages": [user("Hi")], "max_tokens": 3})
        metrics = server.get("/metrics").text
    forwards = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("mmkv_decode_batch_rows_count"))  # fmt: skip
    assert forwards < 1500 - 100 and later["finish"] in ("length", "stop")
