"""Desktop episodes through a real ``mmkv serve``, run by ``examples/agent.py`` (the official ``openai`` client)
and by pydantic-ai (a framework nobody here wrote): every call reaches the app, the tool results carry the next
screenshot, the history is resent with a window of screenshots, and the images' KV comes from the pool and the
store. On tiny-qwen3-vl (random weights) the calls are forced (``tool_choice="required"``) and wrong; on the
retrained shipped checkpoint the model decides, and its per-step accuracy is asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from examples.agent import run as run_agent
from mmkv.envs import SCREEN_TEXT, DesktopApp, FunctionCall, message_images
from mmkv.model.registry import SHIPPED_DIR

from .agent_frameworks import pydantic_ai_episode
from .conftest import InProcessServer

pytestmark = pytest.mark.frameworks

TOOL_NAMES = {"click", "fill", "escalate"}
# Random weights may run fill's free ``text`` argument past max_tokens (its JSON then cut off, which pydantic-ai
# answers with a retry prompt, not a call): the tiny run forces calls of click (pydantic-ai sends a named
# tool_choice for one name; for several it sends {"type": "allowed_tools"}, which mmkv serve refuses with a 400).
FORCED = ["click"]


def is_tool_trained(name: str) -> bool:
    """Whether the shipped checkpoint ``name`` was trained to call tools (its chat template renders them)."""
    template = SHIPPED_DIR / name / "chat_template.jinja"
    return template.exists() and "tool_call" in template.read_text()


def _replayed(calls: list[FunctionCall], seed: int, split: str = "heldout") -> list:
    """The app's answers to ``calls`` made in order on a fresh episode of ``seed``."""
    app = DesktopApp(split)
    app.reset(seed)
    return [app.step(c.name, c.arguments) for c in calls]


def _check_sources(per_step: list[list[str]], window: int) -> None:
    """kv through the server: the first request computes its screenshot; later ones keep every earlier
    screenshot from the pool (``live``) or splice it from the store (``memory``), never recompute it; once the
    window slid, the oldest kept screenshot moved and is spliced."""
    assert per_step[0] == ["computed"]
    for step, sources in enumerate(per_step[1:], start=1):
        assert len(sources) == min(window, step + 1), (step, sources)
        assert all(s in ("live", "memory") for s in sources[:-1]), (step, sources)
        if step >= window:
            assert sources[0] == "memory", (step, sources)


def test_the_agent_example_runs_episodes_through_the_server(server):
    """examples/agent.py on tiny-qwen3-vl, window 2: each step's call is a listed tool and reached the app (the
    app replayed with the same calls agrees on every verdict), the resent history pairs each call with a tool
    message holding the result text and the next screenshot, and the images' KV comes from the pool and the
    store; under ``reuse none`` nothing is spliced."""
    (result,) = run_agent(f"{server.base_url}/v1", "tiny-qwen3-vl", episodes=1, seed=4, window=2, quiet=True)
    app = DesktopApp("heldout")
    app.reset(4)
    assert 1 <= len(result.steps) <= app.max_steps
    calls = []
    for message in result.messages:
        for entry in message.get("tool_calls") or ():
            arguments = entry["function"]["arguments"]
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:  # random weights: a free string argument cut off by max_tokens
                parsed = {}
            calls.append(FunctionCall(entry["function"]["name"], parsed if isinstance(parsed, dict) else {}))
    assert len(calls) == len(result.steps) and {c.name for c in calls} <= TOOL_NAMES
    replay = _replayed(calls, 4)
    assert [r.is_right for r in replay] == [s.is_right for s in result.steps]
    assert [str(r.expected) for r in replay] == [s.expected for s in result.steps]
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    ids = [m["tool_calls"][0]["id"] for m in result.messages if m.get("tool_calls")]
    assert [m["tool_call_id"] for m in tool_messages] == ids
    for message, outcome in zip(tool_messages, replay, strict=True):
        assert message["content"][0]["text"] == outcome.text
        (image,) = message_images([message])
        assert np.array_equal(np.asarray(image), np.asarray(outcome.image))
    _check_sources([list(s.sources) for s in result.steps], 2)
    assert all(s.cached_tokens > 0 for s in result.steps[1:])

    (plain,) = run_agent(
        f"{server.base_url}/v1", "tiny-qwen3-vl", 1, seed=5, window=2, reuse="none", quiet=True
    )
    assert all(src in ("live", "computed") for s in plain.steps for src in s.sources)


def test_pydantic_ai_runs_the_episodes(server):
    """pydantic-ai, its function tools the app's actions (the app's schemas), each returning the result and the
    next screenshot: every call the model made reached the app in order, the next request carries that call,
    its result and the screenshot (in a user message after the tool message), at most ``window`` screenshots
    are sent, the run ends with the episode, and the images' KV comes from the pool and the store."""
    episode = pydantic_ai_episode(f"{server.base_url}/v1", "tiny-qwen3-vl", seed=6, window=2, force=FORCED)
    app = DesktopApp("heldout")
    app.reset(6)
    assert episode.calls and len(episode.requests) == len(episode.calls)
    replay = _replayed(episode.calls, 6)
    assert [r.text for r in replay] == [r.text for r in episode.results]
    assert len(episode.calls) == app.max_steps or replay[-1].done  # the run ended when the episode did
    for k, request in enumerate(episode.requests[1:]):
        messages = request["messages"]
        assistant, tool, screen = messages[-3:]
        (entry,) = assistant["tool_calls"]
        assert (
            FunctionCall(entry["function"]["name"], json.loads(entry["function"]["arguments"]))
            == episode.calls[k]
        )
        assert tool == {"role": "tool", "tool_call_id": entry["id"], "content": episode.results[k].text}
        assert screen["role"] == "user" and screen["content"][0]["text"] == SCREEN_TEXT
        (image,) = message_images([screen])
        assert np.array_equal(np.asarray(image), np.asarray(episode.results[k].image))
        assert len(message_images(messages)) <= 2
    _check_sources([[i["source"] for i in reply["images"]] for reply in episode.replies], 2)


# ------------------------------------------------------------------------------ the retrained checkpoint
SHIPPED = "small-qwen3-vl"
EPISODES, FIRST_SEED = 6, 100  # held-out episodes the shipped-model tests run
# per-step accuracy the shipped checkpoint reaches on these six held-out episodes (greedy, so it repeats), measured
# once and set a little below (the target, 0.95, is missed: README, Results): examples/agent.py with
# tool_choice "required" 28 of 40 = 0.70; pydantic-ai deciding itself ("auto", its own history) 27 of 41 = 0.66
MIN_STEP_ACCURACY_REQUIRED = 0.68
MIN_STEP_ACCURACY_FRAMEWORK = 0.64


@pytest.fixture(scope="module")
def shipped_server(tmp_path_factory):
    if not is_tool_trained(SHIPPED):
        pytest.skip(f"checkpoints/{SHIPPED} does not call tools yet (not retrained)")
    server = InProcessServer(
        ["--model", SHIPPED, "--device", "cpu"], tmp_path_factory.mktemp("shipped") / "log"
    )
    with server:
        yield server


def test_the_shipped_model_acts_through_the_agent_example(shipped_server):
    """examples/agent.py on the retrained checkpoint, every answer constrained to a call (tool_choice
    required): every step has a call, and the per-step accuracy on held-out episodes is at least
    MIN_STEP_ACCURACY_REQUIRED."""
    results = run_agent(f"{shipped_server.base_url}/v1", SHIPPED, EPISODES, FIRST_SEED, 3, tool_choice="required",
                        quiet=True)  # fmt: skip
    steps = [s for r in results for s in r.steps]
    assert all(s.call for s in steps)
    assert sum(s.is_right for s in steps) / len(steps) >= MIN_STEP_ACCURACY_REQUIRED
    for r in results:
        _check_sources([list(s.sources) for s in r.steps], 3)


def test_the_shipped_model_acts_through_pydantic_ai(shipped_server):
    """pydantic-ai on the retrained checkpoint, the model deciding (auto): per-step accuracy on the same
    held-out episodes at least MIN_STEP_ACCURACY_FRAMEWORK."""
    episodes = [
        pydantic_ai_episode(f"{shipped_server.base_url}/v1", SHIPPED, seed, window=3, force=None)
        for seed in range(FIRST_SEED, FIRST_SEED + EPISODES)
    ]
    results = [r for e in episodes for r in e.results]
    assert results and sum(r.is_right for r in results) / len(results) >= MIN_STEP_ACCURACY_FRAMEWORK
