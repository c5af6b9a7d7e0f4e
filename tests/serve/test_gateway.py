"""Replicas behind the real gateway (SMG, the ``gateway`` extra) on one real ``redis-server``, driven with the
official openai client: the answers a single server gives, a conversation kept on its replica, screenshots shared
through Redis, and the faults (a replica SIGKILLed mid-answer, restarted; Redis killed)."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest

from mmkv.envs import DesktopApp, image_data_url, keep_last_screenshots, tool_result_messages
from mmkv.model.families.qwen_vl import QWEN_SPECIAL_TOKENS
from mmkv.serve.gateway import GatewayProcess, gateway_binary
from mmkv.serve.process import running
from tests.redis_server import RedisServer
from tests.serve.conftest import RunningServer, image_part, user

pytestmark = [pytest.mark.gateway, pytest.mark.redis]
MODEL = "tiny-qwen3-vl"
END_OF_TURN = str(QWEN_SPECIAL_TOKENS.index("<|im_end|>"))  # the tiny tokenizers put special tokens first


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Redis, replicas ``a`` and ``b`` on it, ``single`` (a server of its own, the reference) and the gateway
    (``cache_aware``) over ``a`` and ``b``; the three servers load at once."""
    if gateway_binary() is None:
        pytest.skip('the smg gateway is not installed (pip install -e ".[gateway]"; .ci/run installs it)')
    tmp = tmp_path_factory.mktemp("fleet")
    with RedisServer() as redis_server:
        a, b, single = (RunningServer(["--model", MODEL, "--device", "cpu", *store], tmp / f"{name}.log")
                        for name, store in (("a", ["--store", redis_server.url]), ("b", ["--store", redis_server.url]),
                                            ("single", [])))  # fmt: skip
        with (
            running([a, b, single]),
            GatewayProcess([a.base_url, b.base_url], tmp / "gateway.log") as gateway,
        ):
            yield type("Fleet", (), {"redis": redis_server, "a": a, "b": b, "single": single, "gateway": gateway,
                                     "tmp": tmp})  # fmt: skip


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _episode(client: openai.OpenAI, seed: int, steps: int) -> list[dict]:
    """A desktop agent's episode as an agent runs it (tool_choice required, the history resent with the last 2
    screenshots): per request its answer (the call or the text) and the server's report."""
    app = DesktopApp("heldout")
    first = app.reset(seed)
    messages = [{"role": "system", "content": app.policy},
                {"role": "user", "content": [{"type": "text", "text": first.text},
                                             {"type": "image_url", "image_url": {"url": image_data_url(first.image)}}]}]  # fmt: skip
    out = []
    for _ in range(steps):
        reply = client.chat.completions.create(
            model=MODEL, messages=keep_last_screenshots(messages, 2), tools=app.tools(), tool_choice="required",
            parallel_tool_calls=False, max_tokens=48, temperature=0,
        )  # fmt: skip
        (call,) = reply.choices[0].message.tool_calls
        out.append({"call": (call.function.name, call.function.arguments), "mmkv": reply.model_extra["mmkv"],
                    "cached": reply.usage.prompt_tokens_details.cached_tokens})  # fmt: skip
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})  # fmt: skip
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = {}
        outcome = app.step(call.function.name, arguments if isinstance(arguments, dict) else {})
        messages += tool_result_messages(call.id, outcome.text, outcome.image, "tool")
        if app.done:
            break
    return out


def test_agents_through_the_gateway_get_a_single_servers_answers_from_their_replicas_pool(fleet):
    """Three tool-calling agents at once through the gateway: every call equals the one a single server chooses
    for the same episode. Then agents one at a time: each conversation's requests all land on one replica, and
    from the second on it continues from that replica's pool and stores (no screenshot recomputed or fetched
    from Redis, most of the prompt cached)."""
    through = {}

    def agent(seed: int) -> None:
        through[seed] = _episode(_client(fleet.gateway.base_url), seed, 3)

    threads = [threading.Thread(target=agent, args=(seed,)) for seed in (11, 12, 13)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed in (11, 12, 13):
        alone = _episode(_client(fleet.single.base_url), seed, 3)
        assert [step["call"] for step in through[seed]] == [step["call"] for step in alone]
    for seed in (21, 22):
        before = (fleet.a.answered(), fleet.b.answered())
        steps = _episode(_client(fleet.gateway.base_url), seed, 3)
        served = (fleet.a.answered() - before[0], fleet.b.answered() - before[1])
        assert len(steps) >= 2 and sorted(served) == [0, len(steps)], served
        for step in steps[1:]:
            kept = [image["source"] for image in step["mmkv"]["images"]][:-1]  # the newest screenshot is new
            assert kept and set(kept) <= {"live", "memory"}, step["mmkv"]["images"]
            assert step["cached"] > step["mmkv"]["prefilled_tokens"]


def test_a_screenshot_first_seen_on_one_replica_is_a_redis_hit_on_the_other(fleet):
    """Round robin over the same replicas: two new conversations sharing a screenshot land on different replicas;
    the second gets its KV from Redis and answers as the single server does."""
    with GatewayProcess(
        [fleet.a.base_url, fleet.b.base_url], fleet.tmp / "rr.log", policy="round_robin"
    ) as rr:
        sources, answers = [], []
        for question in ("What is on the screen?", "Which button is red?"):
            messages = [user(image_part(501), question)]
            reply = _client(rr.base_url).chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                                 temperature=0)  # fmt: skip
            sources += [image["source"] for image in reply.model_extra["mmkv"]["images"]]
            single = _client(fleet.single.base_url).chat.completions.create(model=MODEL, messages=messages,
                                                                            max_tokens=6, temperature=0)  # fmt: skip
            answers.append((reply.choices[0].message.content, single.choices[0].message.content))
    assert sources == ["computed", "redis"]
    assert all(ours == theirs for ours, theirs in answers)


def test_a_draining_replicas_refusals_are_retried_on_the_other_and_one_alone_forwards_them(fleet):
    """SIGTERM replica ``a`` while it streams: behind a gateway that has not yet seen its health change
    (checks every 60 s), requests the round robin sends to ``a`` get its 503 ``draining`` and are retried on
    ``b``, so every client gets a 200 answer; a gateway over ``a`` alone forwards the 503 as it is (the
    error object, ``Retry-After``). Its stream's client leaves; ``a`` exits 0 and is restarted."""
    slow = ("--health-check-interval-secs", "60", "--health-failure-threshold", "100")
    with GatewayProcess([fleet.a.base_url, fleet.b.base_url], fleet.tmp / "rr-slow.log", policy="round_robin",
                        extra=slow) as pair, \
            GatewayProcess([fleet.a.base_url], fleet.tmp / "alone.log", extra=slow) as alone:  # fmt: skip
        with _long_stream(fleet.a.base_url, 701, max_tokens=2000) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            fleet.a.process.send_signal(signal.SIGTERM)
            for _ in range(500):  # until a answers as draining (a bound, not a measurement)
                if fleet.a.get("/health").status_code == 503:
                    break
            body = {"model": MODEL, "messages": [user("hi")], "max_tokens": 2}
            refused = httpx.post(f"{alone.base_url}/v1/chat/completions", json=body, timeout=60)
            assert refused.status_code == 503 and refused.headers.get("retry-after") == "1"
            assert refused.json()["error"]["code"] == "draining"
            statuses = [httpx.post(f"{pair.base_url}/v1/chat/completions", json=body, timeout=60).status_code
                        for _ in range(4)]  # fmt: skip
            assert statuses == [200] * 4
            assert fleet.a.log.read_text().count("status=503 error=the server is draining") >= 3
    assert fleet.a.process.wait(timeout=60) == 0  # the stream's client left: nothing held, a exits
    fleet.a.restart()
    fleet.gateway.wait_healthy(2)


def _long_stream(base_url: str, seed: int, max_tokens: int = 400):
    """A streamed answer of ``max_tokens`` tokens (the end of turn biased away)."""
    return httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [user(image_part(seed), "Describe everything.")], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "logit_bias": {END_OF_TURN: -100, "0": -100}})  # fmt: skip


def _holder(fleet):
    """The replica answering a request now (its /health counts one running), and the other one."""
    for _ in range(500):
        for server, other in ((fleet.a, fleet.b), (fleet.b, fleet.a)):
            if httpx.get(f"{server.base_url}/health", timeout=5).json()["running"]:
                return server, other
    raise AssertionError("no replica ever ran the request")


def test_a_replica_killed_mid_answer_fails_cleanly_the_survivor_serves_from_redis_and_it_rejoins(fleet):
    """SIGKILL the replica holding a streamed answer: the client's stream ends short without a finish it did
    not reach; the gateway stops routing to it; a conversation that replica served goes on at the survivor with
    its screenshot from Redis and the single server's answer; restarted, the replica rejoins and
    answers. Then Redis is killed: the replicas fall back to their own tiers, the gateway keeps routing, and
    the answers stay the single server's."""
    gateway, client = fleet.gateway, _client(fleet.gateway.base_url)
    seen = [user(image_part(601), "What is on the screen?")]
    finish = None
    with _long_stream(gateway.base_url, 602) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        dead, _ = _holder(fleet)
        first = _client(dead.base_url).chat.completions.create(model=MODEL, messages=seen, max_tokens=6,
                                                               temperature=0)  # fmt: skip
        assert [image["source"] for image in first.model_extra["mmkv"]["images"]] == ["computed"]
        dead.kill()
        try:
            for line in lines:
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    finish = (event.get("choices") or [{}])[0].get("finish_reason") or finish
                    assert "error" not in event or event["error"]["message"]
        except httpx.HTTPError:
            pass  # the connection cut: the client sees the stream end without a finish
    assert finish in (None, "error")  # never a "length" or "stop" it did not reach
    gateway.wait_healthy(1)
    again = client.chat.completions.create(model=MODEL, messages=seen, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert [image["source"] for image in again.model_extra["mmkv"]["images"]] == ["redis"]
    single = _client(fleet.single.base_url).chat.completions.create(model=MODEL, messages=seen, max_tokens=6,
                                                                    temperature=0)  # fmt: skip
    assert again.choices[0].message.content == single.choices[0].message.content
    dead.restart()
    gateway.wait_healthy(2)
    assert dead.get("/health").json()["status"] == "ok"

    fleet.redis.kill()
    try:
        for seed in (603, 604, 605):
            messages = [user(image_part(seed), "What is on the screen?")]
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0
            )
            single = _client(fleet.single.base_url).chat.completions.create(model=MODEL, messages=messages,
                                                                            max_tokens=6, temperature=0)  # fmt: skip
            assert reply.choices[0].message.content == single.choices[0].message.content
            assert [image["source"] for image in reply.model_extra["mmkv"]["images"]] == ["computed"]
        assert gateway.healthy_workers() == 2
    finally:
        fleet.redis.start()
