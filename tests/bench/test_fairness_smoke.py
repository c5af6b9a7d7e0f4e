"""bench/fairness.py end to end against this tree alone: the baseline and one hostile class, and the cache attack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fairness import CLASSES, SALT, body, templates

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def test_every_hostile_body_is_distinct_and_within_the_request_bounds():
    """Two requests of a class differ (each its own salt) and are the same size; every body is JSON nested no
    deeper than the server's bound of 64 (so a hostile schema reaches the schema checks, not the body check)."""
    from mmkv.serve.app import MAX_JSON_DEPTH, _depth

    for name in CLASSES:
        bodies = templates(name, "tiny-qwen3-vl")
        first, second = body(bodies, 2), body(bodies, 4)
        assert first != second and len(first) == len(second) and SALT.encode() not in first, name
        assert _depth(first) <= MAX_JSON_DEPTH, name
        json.loads(first)


def test_smoke_reports_the_arms_and_the_cache_attack(tmp_path):
    """``const`` at one client for 2 s: this tree refuses every 5 MB const schema (400) in the arm and in the
    attack; plain requests were answered; the JSON names the tree's commit."""
    out = tmp_path / "f.json"
    done = subprocess.run(
        [sys.executable, "bench/fairness.py", "--trees", str(ROOT), "--classes", "const", "--levels", "1",
         "--seconds-per-arm", "2", "--rounds", "1", "--settle", "0", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,  # a hang guard, not a speed bound
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    (label,) = result["trees"]
    assert len(result["trees"][label]["commit"]) == 40
    assert set(result["arms"]) == {"none", "const x1"}
    none, const = result["arms"]["none"][label]["summary"], result["arms"]["const x1"][label]["summary"]
    assert none["hostile_requests"]["median"] == 0 and none["plain_requests"]["median"] >= 1
    assert const["hostile_requests"]["median"] >= 1 and set(const["hostile_statuses"]) == {"400"}
    assert "200" in const["plain_statuses"]
    (attack,) = result["cache_attack"][label]
    assert attack["statuses"] == {"400": 8} and attack["rss_before_mb"] > 0
    assert "const x1" in done.stdout and "cache attack" in done.stdout
