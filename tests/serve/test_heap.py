"""mmkv.serve.heap: the worker gives freed heap memory back every 64 requests, whatever the requests did."""

from __future__ import annotations

import pytest

from mmkv.serve.heap import HeapTrim, malloc_trim


@pytest.mark.parametrize("every, ticks, trims", [(1, 5, 5), (3, 10, 3), (64, 63, 0), (64, 128, 2)])
def test_the_heap_is_trimmed_every_nth_request(every, ticks, trims):
    calls = []
    heap = HeapTrim(every, trim=lambda: calls.append(1) or True)
    done = [heap.tick() for _ in range(ticks)]
    assert len(calls) == heap.trims == trims == sum(done)
    assert [k + 1 for k, d in enumerate(done) if d] == [every * (m + 1) for m in range(trims)]


@pytest.mark.parametrize("every", [0, -1])
def test_a_bound_below_one_is_refused(every):
    with pytest.raises(ValueError, match="every must be >= 1"):
        HeapTrim(every)


def test_malloc_trim_runs_here():
    """On this Linux machine glibc is there: the call returns a bool and nothing breaks (on other systems it
    returns False)."""
    assert malloc_trim() in (True, False)


def test_the_worker_counts_every_request_it_runs_and_only_those():
    """Through the app on the tiny model: requests that answer are each counted once; a prompt past the model's
    positions is refused from its size before it reaches the model thread (400, not counted)."""
    from starlette.testclient import TestClient

    from mmkv.serve import Engine, ServerConfig
    from mmkv.serve.app import create_app

    engine = Engine(ServerConfig(model="tiny-qwen3-vl", device="cpu"))
    statuses = []
    with TestClient(create_app(engine)) as client:
        for text in ["hello", "word " * 40_000, "again"]:
            body = {
                "model": "tiny-qwen3-vl",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 2,
            }
            statuses.append(client.post("/v1/chat/completions", json=body).status_code)
    engine.close()
    assert statuses == [200, 400, 200] and engine.worker.heap._count == 2


def test_an_over_long_prompt_is_refused_from_its_size_before_it_is_tokenised(monkeypatch):
    """Text that cannot fit the model's positions (at least bytes / longest token tokens) is a 400 naming the
    bound, and nothing was laid out or tokenised for it; a prompt of several forms (content, parts, tool-call
    arguments) counts."""
    from starlette.testclient import TestClient

    from mmkv.prompt.blocks import LayoutBuilder
    from mmkv.serve import Engine, ServerConfig
    from mmkv.serve.app import create_app

    engine = Engine(ServerConfig(model="tiny-qwen3-vl", device="cpu"))
    built = []
    original = LayoutBuilder.build
    monkeypatch.setattr(
        LayoutBuilder, "build", lambda self, *a, **k: built.append(1) or original(self, *a, **k)
    )
    huge = "x" * (engine._token_bytes * (engine.handle.max_positions + 1))
    forms = [
        [{"role": "user", "content": huge}],
        [{"role": "user", "content": [{"type": "text", "text": huge[: len(huge) // 2]},
                                      {"type": "text", "text": huge[len(huge) // 2 :]}]}],
        [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
          "function": {"name": "f", "arguments": huge}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
    ]  # fmt: skip
    with TestClient(create_app(engine)) as client:
        for messages in forms:
            reply = client.post("/v1/chat/completions", json={"model": "tiny-qwen3-vl", "messages": messages})
            assert reply.status_code == 400 and "positions" in reply.json()["error"]["message"], reply.text
        assert not built
        ok = client.post("/v1/chat/completions", json={"model": "tiny-qwen3-vl", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert ok.status_code == 200 and built
    engine.close()
