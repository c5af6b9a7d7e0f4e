"""training/finalise.py: the best-scoring checkpoint of a run is shipped with the run's reports."""

from __future__ import annotations

import json

import pytest

from training import finalise

pytestmark = pytest.mark.training


def _line(step: int, vqa: float, tool: float, final: bool = False) -> dict:
    line = {"step": step, "heldout_quick": {"a": vqa, "b": vqa}, "tools_quick": {"step_accuracy": tool}}
    return line | ({"final": True} if final else {})


def _write_curve(run, lines: list[dict]) -> None:
    (run / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _read_curve(directory) -> list[dict]:
    return [json.loads(t) for t in (directory / "progress.jsonl").read_text().splitlines()]


def test_the_best_checkpoint_and_the_reports_are_copied(tmp_path, monkeypatch):
    """Step 200 scores best (0.5*0.8 + 0.5*0.9); step 0 has no checkpoint; the final one scores less."""
    run = tmp_path / "run"
    for directory in (run / "step-000100", run / "step-000200", run):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "model.safetensors").write_text(directory.name)
        (directory / "config.json").write_text("{}")
    lines = [_line(0, 1.0, 1.0), _line(100, 0.5, 0.5), _line(200, 0.8, 0.9), _line(300, 0.9, 0.7, final=True)]
    _write_curve(run, lines)
    (run / "training_report.json").write_text(json.dumps({"steps_done": 300}))
    monkeypatch.setattr(finalise, "ROOT", tmp_path)
    assert finalise.finalise(run, "small-qwen3-vl", dry_run=True) == run / "step-000200"
    assert not (tmp_path / "checkpoints").exists()
    finalise.finalise(run, "small-qwen3-vl")
    shipped = tmp_path / "checkpoints" / "small-qwen3-vl"
    assert (shipped / "model.safetensors").read_text() == "step-000200"
    report = json.loads((shipped / "training_report.json").read_text())
    assert report["shipped_step"] == 200 and report["steps_done"] == 300
    assert (shipped / "progress.jsonl").read_text() == (run / "progress.jsonl").read_text()


def test_a_continued_run_ships_one_learning_curve(tmp_path, monkeypatch):
    """A run continued from step 200 of an earlier one: the shipped curve is the earlier run's lines up to
    step 200, then the continuation's (its step-0 line, a repeat, dropped) with steps and seconds counted on;
    the best checkpoint comes from the continuation; the report lists the earlier run's settings and the total
    time."""
    first, second = tmp_path / "first", tmp_path / "second"
    for directory in (first / "step-000200", second / "step-000050", second):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "model.safetensors").write_text(directory.name)
    (first / "settings.json").write_text(json.dumps({"lr": 1e-3}))
    (second / "settings.json").write_text(json.dumps({"lr": 5e-4, "init": str(first / "step-000200")}))
    earlier = [_line(0, 0.1, 0.0) | {"seconds": 0}, _line(200, 0.5, 0.5) | {"seconds": 100},
               _line(300, 0.6, 0.6) | {"seconds": 150}]  # fmt: skip
    later = [_line(0, 0.5, 0.5) | {"seconds": 0}, _line(50, 0.7, 0.8) | {"seconds": 40},
             _line(80, 0.6, 0.7, final=True) | {"seconds": 70}]  # fmt: skip
    for run, lines in ((first, earlier), (second, later)):
        _write_curve(run, lines)
    (second / "training_report.json").write_text(json.dumps({"steps_done": 80}))
    monkeypatch.setattr(finalise, "ROOT", tmp_path)
    finalise.finalise(second, "small-qwen2.5-vl", earlier=[first])
    shipped = tmp_path / "checkpoints" / "small-qwen2.5-vl"
    assert (shipped / "model.safetensors").read_text() == "step-000050"
    curve = _read_curve(shipped)
    assert [(x["run"], x["step"], x["seconds"]) for x in curve] == [
        ("first", 0, 0),
        ("first", 200, 100),
        ("second", 250, 140),
        ("second", 280, 170),
    ]
    report = json.loads((shipped / "training_report.json").read_text())
    assert report["shipped_step"] == 50 and report["total_seconds"] == 170
    assert report["earlier_runs"] == [{"run": str(first), "lr": 1e-3}]


def test_a_run_continued_from_a_shipped_checkpoint_keeps_its_whole_history(tmp_path, monkeypatch):
    """Continued from a copy of a shipped checkpoint (``--init checkpoints/<name>``): the shipped curve's lines
    keep their own run tags and cumulative steps, the continuation counts on from its last line, and the
    shipped report's earlier runs come first in ``earlier_runs``, followed by that report itself."""
    shipped_before, run = tmp_path / "shipped-before", tmp_path / "cont"
    for directory in (shipped_before, run):
        directory.mkdir()
        (directory / "model.safetensors").write_text(directory.name)
    old_curve = [_line(0, 0.1, 0.1) | {"seconds": 0, "run": "a"}, _line(100, 0.3, 0.3) | {"seconds": 50, "run": "a"},
                 _line(300, 0.5, 0.5, final=True) | {"seconds": 90, "run": "b"}]  # fmt: skip
    _write_curve(shipped_before, old_curve)
    old_report = {"lr": 5e-4, "shipped_step": 200, "earlier_runs": [{"run": "/runs/a", "lr": 1e-3}]}
    (shipped_before / "training_report.json").write_text(json.dumps(old_report))
    (run / "settings.json").write_text(json.dumps({"lr": 1e-4, "init": "checkpoints/small-qwen3-vl"}))
    new_curve = [_line(0, 0.5, 0.5) | {"seconds": 0}, _line(40, 0.7, 0.7, final=True) | {"seconds": 30}]
    _write_curve(run, new_curve)
    (run / "training_report.json").write_text(json.dumps({"steps_done": 40}))
    monkeypatch.setattr(finalise, "ROOT", tmp_path)
    finalise.finalise(run, "small-qwen3-vl", earlier=[shipped_before])
    shipped = tmp_path / "checkpoints" / "small-qwen3-vl"
    curve = _read_curve(shipped)
    assert [(x["run"], x["step"], x["seconds"]) for x in curve] == [
        ("a", 0, 0),
        ("a", 100, 50),
        ("b", 300, 90),
        ("cont", 340, 120),
    ]
    report = json.loads((shipped / "training_report.json").read_text())
    assert report["earlier_runs"] == [
        {"run": "/runs/a", "lr": 1e-3},
        {"run": str(shipped_before), "lr": 5e-4, "shipped_step": 200},
    ]
    assert report["total_seconds"] == 120 and report["shipped_step"] == 40


def test_shipping_over_a_checkpoint_never_rewrites_the_files_in_place(tmp_path, monkeypatch):
    """A server may have the shipped weights memory-mapped: shipping anew puts new files in their place
    (new inodes) and leaves what a reader opened before intact, with no partial files left behind."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_bytes(b"new weights")
    (run / "config.json").write_text("{}")
    (run / "progress.jsonl").write_text(json.dumps(_line(5, 0.5, 0.5, final=True)) + "\n")
    (run / "training_report.json").write_text("{}")
    shipped = tmp_path / "checkpoints" / "small-qwen3-vl"
    shipped.mkdir(parents=True)
    (shipped / "model.safetensors").write_bytes(b"old weights")
    monkeypatch.setattr(finalise, "ROOT", tmp_path)
    with open(shipped / "model.safetensors", "rb") as reader:
        finalise.finalise(run, "small-qwen3-vl")
        assert reader.read() == b"old weights"
    assert (shipped / "model.safetensors").read_bytes() == b"new weights"
    assert not list(shipped.glob(".*.partial"))
