"""bench/serve.py --smoke: every arm at every load, each load's content new to the servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_reports_every_arm_and_no_load_is_served_from_an_earlier_one(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/serve.py", "--smoke", "--json", str(tmp_path / "s.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=3600,  # a hang guard, not a speed bound
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "s.json").read_text())
    assert set(result["screenshots"]) == {"kv", "none", "no reuse"}
    for name, rows in result["screenshots"].items():
        assert [r["load"] for r in rows] == [2.0, 4.0] and all(r["requests"] == 6 for r in rows)
        assert all(r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] for r in rows)
        for row in rows:  # every load's screenshots are new: its first turns compute them
            assert row["sources"].get("computed", 0) > 0, (name, row)
    assert all(r["cached_fraction"] == 0 for r in result["screenshots"]["no reuse"])
    for row in result["screenshots"]["kv"]:  # the window slid: stored screenshots spliced at new positions
        assert row["sources"].get("memory", 0) > 0 and row["cached_fraction"] > 0
    assert set(result["fields"]) == {"in place", "erratum"}
    for rows in result["fields"].values():
        assert all(r["after_change"]["requests"] > 0 for r in rows)
