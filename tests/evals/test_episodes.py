"""The episode eval: each held-out step scored on its own prompt (right history), per-kind and episode cells."""

from __future__ import annotations

import json

import pytest

from evals.episodes import aggregate, build_parser, heldout_episodes, run, step_inputs
from mmkv.envs import hermes_text
from mmkv.synthetic import picture_digest, picture_split


def test_held_out_episodes_are_held_out_and_distinct():
    episodes = heldout_episodes(4, seed=10)
    assert [e.seed for e in episodes] == [10, 11, 12, 13] and {e.split for e in episodes} == {"heldout"}
    assert all(picture_split(picture_digest(s.image)) == "heldout" for e in episodes for s in e.steps)


def test_a_run_scores_every_step_and_writes_its_files(tmp_path, tiny_by_name):
    """One episode on the tiny model: a record per step, prompts with at most 3 images, the tables written."""
    args = build_parser().parse_args(["--n", "1", "--window", "3", "--out", str(tmp_path)])
    res = run(**{**vars(args), "model": tiny_by_name["tiny-qwen3-vl"]}, progress=False)
    records, episode = res["records"], heldout_episodes(1)[0]
    assert len(records) == len(episode.steps) and [r["step"] for r in records] == list(range(len(records)))
    assert all(
        1 <= r["images"] <= 3 and r["expected"] == str(s.call)
        for r, s in zip(records, episode.steps, strict=True)
    )
    assert json.loads((tmp_path / "results.json").read_text())["aggregate"]["episodes"]["n"] == 1
    assert "| none | all |" in (tmp_path / "results.md").read_text()


def test_the_prompt_ends_where_the_call_begins(tiny_by_name):
    """step_inputs renders the agent's messages with a generation prompt: the call's hermes text follows."""
    handle, episode = tiny_by_name["tiny-qwen3-vl"], heldout_episodes(1)[0]
    inputs = step_inputs(handle.processor, episode.messages(1, as_url=False), episode.tools)
    text = handle.tokenizer.decode(inputs["input_ids"][0])
    assert text.endswith("<|im_start|>assistant\n") and hermes_text(episode.steps[0].call) in text
    assert inputs["image_grid_thw"].shape[0] == 2


def test_aggregate_counts_steps_kinds_history_and_episodes():
    rows = [
        {"seed": 1, "kind": "ok", "uses_history": False, "correct": True, "prompt_tokens": 900, "images": 2},
        {
            "seed": 1,
            "kind": "close",
            "uses_history": True,
            "correct": False,
            "prompt_tokens": 1000,
            "images": 3,
        },
        {"seed": 2, "kind": "ok", "uses_history": False, "correct": True, "prompt_tokens": 800, "images": 1},
    ]
    table = aggregate(rows)
    assert table["steps"]["all"]["n"] == 3 and table["steps"]["all"]["accuracy"]["value"] == pytest.approx(
        2 / 3
    )
    assert table["steps"]["uses history"]["n"] == 1 and table["steps"]["ok"]["accuracy"]["value"] == 1.0
    assert table["episodes"]["n"] == 2 and table["episodes"]["accuracy"]["value"] == 0.5
    assert table["episodes"]["accuracy"]["low"] > 0.0  # Wilson, never a degenerate interval
