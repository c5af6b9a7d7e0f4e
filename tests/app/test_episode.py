"""The demo's agent episode without a browser (``app.episode`` and its handlers in ``app.demo``): on the tiny
model the calls are forced by the grammar and mostly wrong, so what is asserted is what holds whatever the weights:
each call reached the app, the tool results carry the screenshots, and the screenshots' KV comes from the live
prefix and, once the window slid, the store."""

from __future__ import annotations

import copy
import json
from functools import cache

import numpy as np
import pytest

from app import demo
from app.episode import EpisodeRun, EpisodeSettings
from app.format import (
    EPISODE_COLUMNS,
    episode_ttft_points,
    format_episode_log,
    format_episode_policy,
    format_episode_status,
)
from app.trajectory import DEMO_EPISODE_CALLS, DEMO_EPISODE_SEED
from mmkv import Answer, Session
from mmkv.envs import DesktopApp, expert_episode
from mmkv.messages import ToolCall

from .conftest import REPO

pytestmark = pytest.mark.shipped


def _sources(step) -> list[str]:
    return [image.source for image in step.answer.images]


def _row_cells(log: str, number: int) -> dict[str, str]:
    """Step ``number``'s row of the step table, by column header."""
    row = log.splitlines()[1 + number]
    cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
    return dict(zip(EPISODE_COLUMNS, cells, strict=True))


@cache
def _role_change_seed() -> int:
    """A held-out episode whose right path signs the agent in again under another role."""
    return next(
        seed
        for seed in range(200)
        if any("Signed in again" in step.result for step in expert_episode(seed, "heldout").steps)
    )


def _make_right_calls(monkeypatch, run: EpisodeRun) -> None:
    """Replace the model's decision by the policy's: every ``Session.ask`` makes the right call of ``run``'s app
    (the prompt is still brought up to date by the session, so timings and sources are real)."""

    def ask(session, question, max_new_tokens=32, *args, **options):
        expected = run.app.expected_call()
        call = ToolCall(f"call_{len(run.steps)}", expected.name, json.dumps(expected.arguments))
        stats = session.prefill()
        session.add_tool_calls([call])
        return Answer("", (), "stop", stats.seconds, stats.seconds, stats, tool_calls=(call,))

    monkeypatch.setattr(Session, "ask", ask)


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
    a new episode starts over; the per-session state copies share the backend."""
    run = copy.deepcopy(EpisodeRun(backend))
    assert run.backend is backend and not run.started
    screen, log, status, policy, shots, stats, chart = demo.step_episode(run, 4, 3, "kv")
    assert run.seed == 4 and len(run.steps) == 1 and len(shots) == 2 and "account_role" in policy
    outputs = list(demo.run_episode(run, 4, 3, "kv"))
    assert run.done and len(outputs) == len(run.steps) - 1
    assert outputs[-1][2].endswith(
        ("**done: success**", "**done: failed**", "**stopped**: the last answer made no call")
    )
    demo.new_episode(run, 5, 2, "none")
    assert run.seed == 5 and run.steps == [] and run.settings == EpisodeSettings(window=2, reuse="none")


def _bar_heights(figure) -> list[float]:
    return [patch.get_height() for patch in figure.axes[0].patches]


def test_a_step_after_the_end_warns_and_leaves_every_panel(backend):
    """Step once the episode is over: a warning that says it ended (a toast on the page), the same panels as
    before the press (screen, table, status, policy, screenshots, store counters, chart) and no new step."""
    run = EpisodeRun(backend)
    *_, before = demo.run_episode(run, 4, 3, "kv")
    assert run.done
    num_steps = len(run.steps)
    with pytest.warns(UserWarning, match=f"Episode 4 has ended .*{num_steps} steps.*New episode"):
        after = demo.step_episode(run, 4, 3, "kv")
    assert len(run.steps) == num_steps and len(after) == len(before)
    assert np.array_equal(np.asarray(after[0]), np.asarray(before[0]))
    assert after[1:4] == before[1:4] and after[5] == before[5]
    assert [id(shot) for shot in after[4]] == [id(shot) for shot in before[4]]
    assert _bar_heights(after[6]) == _bar_heights(before[6]) and len(_bar_heights(after[6])) == 2 * num_steps


def test_each_step_shows_its_tool_result(backend):
    """The step table's ``tool result`` cell of every step is the app's answer to its call (the text the tool
    message gives the model)."""
    run = EpisodeRun(backend)
    run.reset(3, EpisodeSettings(window=2))
    steps = list(run.run(max_steps=3))
    log = format_episode_log(steps)
    for step in steps:
        assert step.result and _row_cells(log, step.number)["tool result"] == step.result


def test_the_policy_panel_follows_the_role(backend, monkeypatch):
    """With every call right in an episode that signs the agent in again: the policy panel states the starting
    role until that step, then the new one (and the step), while the system message still states the first;
    the step's tool result in the table says it signed in again."""
    seed = _role_change_seed()
    run = EpisodeRun(backend)
    _make_right_calls(monkeypatch, run)
    run.reset(seed)
    start = run.app.role
    assert f"account_role **{start}**" in format_episode_policy(run)
    for step in run.run():
        panel = format_episode_policy(run)
        if "Signed in again" in step.result:
            break
        assert step.role == start and f"account_role **{start}**" in panel and "Policy now" not in panel
    else:
        pytest.fail("the right path never signed in again")
    new = run.app.role
    assert new != start and step.role == new
    assert panel.startswith(f"**Policy now**: account_role **{new}** (signed in again at step {step.number}")
    assert f"account_role: {new}." in panel and f"still states {start}" in panel
    assert f"account_role: {start}." in run.session.messages[0]["content"][0]["text"]
    assert "Signed in again" in _row_cells(format_episode_log(run.steps), step.number)["tool result"]
    next_step = run.step()
    assert next_step.role == new and "at step " + str(step.number) in format_episode_policy(run)


def test_a_reuse_change_applies_from_the_next_step(backend):
    """The reuse radio changed to ``none`` after two kv steps: the status says it applies from the next step and
    the steps made are unchanged; the next step is answered under ``none`` (its row says so, it was kv) and
    takes no image from the store, where the same step of a kv episode splices one from memory."""
    control = EpisodeRun(backend)
    control.reset(3, EpisodeSettings(window=2))
    assert "memory" in _sources(list(control.run(max_steps=3))[2])

    run = EpisodeRun(backend)
    demo.new_episode(run, 3, 2, "kv")
    demo.step_episode(run, 3, 2, "kv")
    demo.step_episode(run, 3, 2, "kv")
    made = list(run.steps)
    status = demo.change_reuse(run, "none")
    assert "reuse kv → **none from the next step**" in status and run.steps == made
    _, log, status, *_ = demo.step_episode(run, 3, 2, "none")
    step = run.steps[-1]
    assert (step.number, step.reuse, step.reuse_was) == (3, "none", "kv")
    assert run.session.config.reuse == "none"
    assert _sources(step) and "memory" not in _sources(step) and set(_sources(step)) <= {"computed", "live"}
    assert _row_cells(log, 3)["reuse"] == "**none** (was kv; from this step, new live cache)"
    assert [_row_cells(log, n)["reuse"] for n in (1, 2)] == ["kv", "kv"] and "→" not in status
    demo.step_episode(run, 3, 2, "none")
    if len(run.steps) == 4:  # (the tiny model's answer may have ended the episode)
        assert run.steps[3].reuse_was is None
        assert _row_cells(format_episode_log(run.steps), 4)["reuse"] == "none"


def test_the_chart_has_a_reuse_and_a_none_value_per_step(backend):
    """One chart point per step: its TTFT under its policy and the same prompt's prefill on the ``none`` twin,
    which mirrors the conversation message for message and never takes an image from a store; the figure draws
    both bars of every step."""
    run = EpisodeRun(backend)
    run.reset(3, EpisodeSettings(window=2))
    steps = list(run.run(max_steps=4))
    points = episode_ttft_points(steps)
    assert [p.step for p in points] == [s.number for s in steps]
    assert [p.reuse_ms for p in points] == [s.ttft_ms for s in steps] and all(p.reuse == "kv" for p in points)
    assert [p.none_ms for p in points] == [s.no_reuse_ms for s in steps]
    assert all(p.none_ms > 0 for p in points)
    for step in steps:
        assert [image.source for image in step.no_reuse.images] and all(
            image.source in ("computed", "live") for image in step.no_reuse.images
        )
        assert step.no_reuse.prompt_tokens <= step.answer.prompt_tokens
    assert run.twin.session.messages == run.session.messages
    figure = demo.episode_outputs(run)[6]
    assert _bar_heights(figure) == [p.reuse_ms for p in points] + [p.none_ms for p in points]


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
