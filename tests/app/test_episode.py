"""The demo's agent episode without a browser (``app.episode`` and its handlers in ``app.demo``): on the tiny
model the calls are forced by the grammar and mostly wrong, so what is asserted is what holds whatever the weights:
each call reached the app, the tool results carry the screenshots, and the screenshots' KV comes from the live
prefix and, once the window slid, the store."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from app import demo
from app.episode import EpisodeRun, EpisodeSettings
from app.format import format_episode_log, format_episode_status
from app.trajectory import DEMO_EPISODE_CALLS, DEMO_EPISODE_SEED
from mmkv.envs import DesktopApp, expert_episode

from .conftest import REPO


def _sources(step) -> list[str]:
    return [image.source for image in step.answer.images]


def test_steps_act_on_the_app_and_reuse_the_screenshots(backend):
    """Four steps with a window of 2: each call was executed on the app (a fresh app replaying the calls gives
    the same verdicts and screens), the first screenshot is computed, an earlier one is kept live until the
    window slides, then spliced from the store (memory); never recomputed."""
    run = EpisodeRun(backend)
    first = run.reset(3, EpisodeSettings(window=2))
    steps = list(run.run(max_steps=4))
    assert 1 <= len(steps) <= 4 and [s.number for s in steps] == list(range(1, len(steps) + 1))
    replay = DesktopApp("heldout")
    assert np.array_equal(np.asarray(replay.reset(3).image), np.asarray(first))
    for step in (s for s in steps if s.call):
        name, _, rest = step.call.partition("(")
        arguments = dict(kv.split("=", 1) for kv in rest.rstrip(")").split(", ") if kv)
        outcome = replay.step(name, arguments)
        assert outcome.is_right == step.is_right and outcome.text == step.result
        assert np.array_equal(np.asarray(outcome.image), np.asarray(step.screenshot))
    assert _sources(steps[0]) == ["computed"]
    for k, step in enumerate(steps[1:], start=1):
        assert len(step.answer.images) == 2 and _sources(step)[0] in ("live", "memory")
        if k >= 2:
            assert _sources(step)[0] == "memory", (k, _sources(step))
    messages = run.session.messages
    assert [m["role"] for m in messages[:2]] == ["system", "user"] and "tool" in [m["role"] for m in messages]


def test_the_log_and_status_show_each_step(backend):
    """The step table has a row per step with the call, ✓/✗, the right call, TTFT and the images' sources; the
    status line says how many were right and whether the episode is over."""
    run = EpisodeRun(backend)
    assert format_episode_status(run) == "*No episode yet.*" and format_episode_log([]).startswith(
        "*No steps"
    )
    run.reset(1)
    step = run.step()
    log = format_episode_log(run.steps)
    assert log.count("\n") == 2 and f"`{step.expected}`" in log and "1 image: 1 computed" in log
    assert ("✓" if step.is_right else "✗") in log.splitlines()[-1]
    status = format_episode_status(run)
    assert (
        f"1 steps, {int(step.is_right)} right" in status and "seed 1 (heldout, window 3, reuse kv)" in status
    )


def test_handlers_start_step_and_run_an_episode(backend):
    """Step starts the episode of the seed when none runs; Run episode yields after each step until it is over;
    a Step after the end is a gr.Error; a new episode starts over; the per-session state copies share the
    backend."""
    import gradio as gr

    run = copy.deepcopy(EpisodeRun(backend))
    assert run.backend is backend and not run.started
    screen, log, status, policy, shots, stats = demo.step_episode(run, 4, 3, "kv")
    assert run.seed == 4 and len(run.steps) == 1 and len(shots) == 2 and "account_role" in policy
    outputs = list(demo.run_episode(run, 4, 3, "kv"))
    assert run.done and len(outputs) == len(run.steps) - 1
    assert outputs[-1][2].endswith(
        ("**done: success**", "**done: failed**", "**stopped**: the last answer made no call")
    )
    with pytest.raises(gr.Error, match="over"):
        demo.step_episode(run, 4, 3, "kv")
    demo.new_episode(run, 5, 2, "none")
    assert run.seed == 5 and run.steps == [] and run.settings == EpisodeSettings(window=2, reuse="none")


def test_the_demo_episode_is_the_expert_path():
    """The demo's expected calls are the right path of its episode (the shipped model, when it acts right, makes
    exactly these)."""
    assert (
        tuple(str(s.call) for s in expert_episode(DEMO_EPISODE_SEED, "heldout").steps) == DEMO_EPISODE_CALLS
    )


def _is_tool_trained(name: str) -> bool:
    template = REPO / "checkpoints" / name / "chat_template.jinja"
    return template.exists() and "tool_call" in template.read_text()


@pytest.mark.skipif(
    not _is_tool_trained("small-qwen3-vl"), reason="the shipped checkpoint does not call tools yet"
)
def test_the_shipped_model_runs_the_demo_episode_right():
    """small-qwen3-vl runs the demo's episode: every call is the expected one, and from the third step on the
    earliest screenshot in the prompt is a store hit."""
    from app.backend import DemoBackend

    run = EpisodeRun(DemoBackend("small-qwen3-vl", device="cpu"))
    run.reset(DEMO_EPISODE_SEED)
    steps = list(run.run())
    assert tuple(s.call for s in steps) == DEMO_EPISODE_CALLS and run.app.success
    assert all(_sources(s)[0] == "memory" for s in steps[3:])
