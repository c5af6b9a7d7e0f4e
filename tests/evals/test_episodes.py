"""The episode eval: each held-out step scored on its own prompt (right history), per-kind and episode cells."""

from __future__ import annotations

import json

import pytest
import torch

from evals.episodes import aggregate, build_parser, greedy_text, heldout_episodes, run, step_inputs
from mmkv.envs import hermes_text
from mmkv.synthetic import picture_digest, picture_split


def test_held_out_episodes_are_held_out_and_distinct():
    episodes = heldout_episodes(4, seed=10)
    assert [e.seed for e in episodes] == [10, 11, 12, 13] and {e.split for e in episodes} == {"heldout"}
    assert all(picture_split(picture_digest(s.image)) == "heldout" for e in episodes for s in e.steps)


def test_a_run_scores_every_step_and_writes_its_files(tmp_path, tiny_by_name):
    """One episode on the tiny model, both arms: a record per step and arm, prompts with at most 3 images; the
    server renders the prompt the stock path renders (the same token count at every step); kv's images come
    from the pool or the store except the newest; agreement is the same call as none's; the tables written."""
    args = build_parser().parse_args(["--n", "1", "--window", "3", "--out", str(tmp_path)])
    res = run(**{**vars(args), "model": tiny_by_name["tiny-qwen3-vl"]}, progress=False)
    episode = heldout_episodes(1)[0]
    by_arm = {arm: [r for r in res["records"] if r["arm"] == arm] for arm in ("none", "kv")}
    for records in by_arm.values():
        assert len(records) == len(episode.steps) and [r["step"] for r in records] == list(
            range(len(records))
        )
        assert all(
            1 <= r["images"] <= 3 and r["expected"] == str(s.call)
            for r, s in zip(records, episode.steps, strict=True)
        )
    for none, kv in zip(by_arm["none"], by_arm["kv"], strict=True):
        assert kv["prompt_tokens"] == none["prompt_tokens"] and kv["images"] == none["images"]
        assert kv["agree"] == (
            kv["called"] == none["called"] and (kv["called"] != "" or kv["answer"] == none["answer"])
        )
        assert all(s in ("live", "memory") for s in kv["sources"][:-1])
    assert by_arm["kv"][0]["sources"] == ["computed"] and by_arm["kv"][3]["sources"][0] == "memory"
    assert all(r["reused_tokens"] > 0 for r in by_arm["kv"][1:])
    saved = json.loads((tmp_path / "results.json").read_text())["aggregate"]
    assert saved["episodes"]["none"]["n"] == saved["episodes"]["kv"]["n"] == 1
    assert saved["steps"]["none"]["all"]["agreement"]["value"] == 1.0
    markdown = (tmp_path / "results.md").read_text()
    assert "| none | all |" in markdown and "| kv | all |" in markdown


def test_the_prompt_ends_where_the_call_begins(tiny_by_name):
    """step_inputs renders the agent's messages with a generation prompt: the call's hermes text follows."""
    handle, episode = tiny_by_name["tiny-qwen3-vl"], heldout_episodes(1)[0]
    inputs = step_inputs(handle.processor, episode.messages(1, as_url=False), episode.tools)
    text = handle.tokenizer.decode(inputs["input_ids"][0])
    assert text.endswith("<|im_start|>assistant\n") and hermes_text(episode.steps[0].call) in text
    assert inputs["image_grid_thw"].shape[0] == 2


def test_aggregate_counts_steps_kinds_history_agreement_and_episodes():
    """Per arm: accuracy by kind and overall, the history steps, agreement with none, episode success."""
    base = {"prompt_tokens": 900, "images": 2}
    rows = [
        {"seed": 1, "kind": "ok", "uses_history": False, "correct": True} | base,
        {"seed": 1, "kind": "close", "uses_history": True, "correct": False} | base,
        {"seed": 2, "kind": "ok", "uses_history": False, "correct": True} | base,
        {"arm": "kv", "seed": 1, "kind": "ok", "uses_history": False, "correct": True, "agree": True} | base,
        {"arm": "kv", "seed": 1, "kind": "close", "uses_history": True, "correct": True, "agree": False}
        | base,
        {"arm": "kv", "seed": 2, "kind": "ok", "uses_history": False, "correct": True, "agree": True} | base,
    ]
    table = aggregate(rows)
    none, kv = table["steps"]["none"], table["steps"]["kv"]
    assert list(table["steps"]) == ["none", "kv"]
    assert none["all"]["n"] == 3 and none["all"]["accuracy"]["value"] == pytest.approx(2 / 3)
    assert none["uses history"]["n"] == 1 and none["ok"]["accuracy"]["value"] == 1.0
    assert none["all"]["agreement"]["value"] == 1.0 and kv["all"]["agreement"]["value"] == pytest.approx(
        2 / 3
    )
    assert kv["uses history"]["accuracy"]["value"] == 1.0
    assert table["episodes"]["none"]["n"] == 2 and table["episodes"]["none"]["accuracy"]["value"] == 0.5
    assert table["episodes"]["kv"]["accuracy"]["value"] == 1.0
    assert table["episodes"]["none"]["accuracy"]["low"] > 0.0  # Wilson, never a degenerate interval


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_the_reference_answer_is_generate_s_and_leaves_the_shared_model_as_it_was(tiny_by_name, name):
    """greedy_text gives the tokens transformers' greedy ``generate`` gives on the same inputs (two steps' prompts,
    with images), and leaves the model's ``rope_deltas`` as it found it, the very object (generate replaces it)."""
    handle, episode = tiny_by_name[name], heldout_episodes(1, seed=3)[0]
    model, eos = handle.model, handle.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for step in (1, 2):
        inputs = step_inputs(handle.processor, episode.messages(step, as_url=False), episode.tools)
        before = model.model.rope_deltas = torch.tensor([[12345]])  # a sentinel nobody would compute
        ours = greedy_text(handle, inputs, max_new_tokens=12)
        assert model.model.rope_deltas is before
        model.model.rope_deltas = None
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                 pad_token_id=handle.tokenizer.pad_token_id)  # fmt: skip
        model.model.rope_deltas = None
        expected = handle.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert ours == expected and len(out[0]) > inputs["input_ids"].shape[1]
