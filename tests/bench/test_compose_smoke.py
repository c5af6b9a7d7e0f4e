"""bench/compose.py --smoke: both arms timed at every length, the store part loads what another process wrote."""

from __future__ import annotations

import json

import pytest

from bench.compose import growth, main

pytestmark = pytest.mark.bench


def test_smoke_times_both_arms_and_loads_the_other_process_segment_bit_for_bit(tmp_path):
    results = main(["--smoke", "--json", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text()) == json.loads(json.dumps(results))
    lengths = [r["length"] for r in results["rows"]]
    assert lengths == sorted(lengths) and lengths[0] >= 64 and len(lengths) == 3
    for row in results["rows"]:
        for arm in ("splice", "compute"):
            assert 0 < row[arm]["min"] <= row[arm]["median"] <= row[arm]["max"]
        assert row["ratio"] == row["compute"]["median"] / row["splice"]["median"]
    assert set(results["growth"]) == {"splice", "compute"}
    store = results["store"]
    assert store["equal_to_computed"] is True and store["length"] >= 128 and store["bytes"] > 0


def test_growth_is_the_log_log_slope():
    rows = [
        {"length": n, "a": {"median": 3.0 * n}, "b": {"median": 0.5 * n * n}} for n in (100, 200, 400, 800)
    ]
    assert abs(growth(rows, "a", 0) - 1.0) < 1e-9 and abs(growth(rows, "b", 0) - 2.0) < 1e-9
    assert abs(growth(rows, "b", 400) - 2.0) < 1e-9 and growth(rows, "b", 800) is None
