"""bench/gpu.py --smoke: the device script's every step runs on the CPU and returns what the device may send."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench import gpu

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_every_result_within_the_devices_return_limits(tmp_path):
    """Both checkpoints come back as tars holding a loadable checkpoint, the benchmarks write their JSON, and
    the output stays within the device's limits (at most 8 files, none in a subfolder). The smoke plan has no
    time bound (steps and sizes only), so a busy machine is slower, not a failure."""
    assert gpu.SMOKE.train_minutes is None and gpu.SMOKE.rerotate_seconds is None
    assert gpu.SMOKE.session_seconds is None
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,  # a hang guard only: the run is bounded by its steps and sizes
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert all((out / name).is_file() for name in files) and len(files) <= 8, files
    for name in ("small-qwen3-vl", "small-qwen2.5-vl"):
        with tarfile.open(out / f"{name}.tar") as tar:
            members = set(tar.getnames())
        assert {f"{name}/model.safetensors", f"{name}/config.json", f"{name}/progress.jsonl"} <= members
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rerotate_exit"] == 0 and summary["session_tiny-qwen3-vl_exit"] == 0
    for name, result in summary["train"].items():
        assert result["exit"] == 0 and result["report"]["total_steps"] > 0, name
    rows = json.loads((out / "rerotate.json").read_text())["rows"]
    assert {r["arch"] for r in rows} == {"qwen2.5-vl-7b", "qwen3-vl-8b"}
    assert all(r["max_abs"] < 1e-3 and r["floor_ms"] > 0 for r in rows)
    session = json.loads((out / "session-tiny-qwen3-vl.json").read_text())
    assert session["sizes"] and session["sizes"][0]["size"] == 224
