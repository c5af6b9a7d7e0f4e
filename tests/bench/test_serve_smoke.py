"""bench/serve.py --smoke: desktop agents as tool loops at every load and arm, each load's episodes new to the
servers; the mutable-field part at every load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_reports_every_arm_and_no_load_is_served_from_an_earlier_one(tmp_path):
    """Two agents of three steps per arm and load: six requests each with ordered quantiles, an accuracy and an
    episode success per row; every load computes new screenshots; only kv splices stored ones (once the window
    of two slid) and no reuse caches nothing; the field part reports both modes."""
    done = subprocess.run(
        [sys.executable, "bench/serve.py", "--smoke", "--json", str(tmp_path / "s.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=3600,  # a hang guard, not a speed bound
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "s.json").read_text())
    assert set(result["agents"]) == {"kv", "none", "no reuse"}
    for name, rows in result["agents"].items():
        assert [r["load"] for r in rows] == [2.0, 4.0] and all(r["requests"] == 6 for r in rows)
        for row in rows:
            assert row["min_ms"] <= row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
            assert row["episodes"] == 2 and 0 <= row["step_accuracy"] <= 1 and row["episode_success"] == 0
            assert row["sources"].get("computed", 0) > 0, (name, row)  # every load's screenshots are new
    assert all(r["cached_fraction"] == 0 for r in result["agents"]["no reuse"])
    assert all("memory" not in r["sources"] for r in result["agents"]["none"])  # the pool only: no splice
    for row in result["agents"]["kv"]:  # the window slid: stored screenshots spliced at new positions
        assert row["sources"].get("memory", 0) > 0 and row["cached_fraction"] > 0
    assert "| 2 | kv | 6 |" in done.stdout  # the Markdown table
    assert set(result["fields"]) == {"in place", "erratum"}
    for rows in result["fields"].values():
        assert all(r["after_change"]["requests"] > 0 for r in rows)
