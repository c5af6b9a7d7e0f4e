"""evals/report.py: exact binomial intervals for proportions, bootstrap for the rest, cells, tables."""

from __future__ import annotations

import numpy as np
import pytest

from evals.report import (
    EPISODE_METRICS,
    Metric,
    bootstrap,
    cells,
    compose_markdown,
    edit_markdown,
    episode_markdown,
    vqa_markdown,
    wilson,
)


def test_a_cell_without_disagreement_is_not_certain():
    """200 of 200 agree: the Wilson lower bound is 0.981 (the bootstrap said 1.00)."""
    e = wilson(200, 200)
    assert e.value == 1.0 and e.high == 1.0 and e.low == pytest.approx(200 / (200 + 1.959963984540054**2))
    assert 0.980 < e.low < 0.982
    zero = wilson(0, 200)
    assert zero.value == 0.0 and zero.low == 0.0 and 0.018 < zero.high < 0.020


def test_wilson_matches_known_values_and_is_symmetric():
    """Reference values (Newcombe 1998, Wilson without continuity correction): 81/263 -> [0.2553, 0.3662];
    k of n and n - k of n mirror each other."""
    e = wilson(81, 263)
    assert (round(e.low, 4), round(e.high, 4)) == (0.2553, 0.3662)
    a, b = wilson(15, 148), wilson(133, 148)
    assert a.low == pytest.approx(1 - b.high) and a.high == pytest.approx(1 - b.low)
    assert wilson(30, 40).high - wilson(30, 40).low > wilson(300, 400).high - wilson(300, 400).low
    with pytest.raises(ValueError, match="successes"):
        wilson(3, 2)


def test_a_proportion_metric_uses_wilson_and_a_continuous_one_the_bootstrap():
    rows = [{"arm": "a", "g": "x", "ok": i < 19, "t": float(i)} for i in range(20)]
    table = cells(rows, "arm", "g", {"ok": Metric(("ok",)), "t": Metric(("t",), lambda x: x.mean(-1))})
    ok = table["a"]["all"]["ok"]
    expected = wilson(19, 20)
    assert (ok["value"], ok["low"], ok["high"]) == (expected.value, expected.low, expected.high)
    t = table["a"]["x"]["t"]
    same = bootstrap([np.arange(20, dtype=float)], lambda x: x.mean(-1))
    assert (t["value"], t["low"], t["high"]) == (same.value, same.low, same.high) and t["value"] == 9.5


def test_cells_order_arms_then_groups_and_add_extras():
    """Arms in the given order first, groups by first appearance then "all"; extras see the cell's records."""
    rows = [{"arm": arm, "g": g, "ok": 1} for arm in ("b", "c", "a") for g in ("y", "x")]
    table = cells(rows, "arm", "g", {"ok": Metric(("ok",))}, arm_order=("a", "b"), extras={"k": len})
    assert list(table) == ["a", "b", "c"] and list(table["a"]) == ["y", "x", "all"]
    assert table["a"]["all"]["k"] == 2 and table["a"]["y"]["n"] == 1


def test_every_eval_table_renders_its_cells():
    """Each eval's Markdown has a header, a separator and one row per arm and group."""
    est = {"value": 0.5, "low": 0.4, "high": 0.6}
    cell = {"n": 3, "min_abs_shift": None, "max_abs_shift": None} | {
        k: est for k in ("accuracy", "agreement", "cosine", "ttft_s", "speedup", "reused_fraction", "follows_old",
                         "fraction", "edit_ms", "prompt_tokens", "images")
    }  # fmt: skip
    table = {"kv": {"g": cell, "all": cell}}
    for markdown in (vqa_markdown(table), edit_markdown(table), compose_markdown(table)):
        lines = markdown.splitlines()
        assert len(lines) == 4 and lines[2].startswith("| kv | g | 3 | 0.50 [0.40, 0.60]")
    episodes = episode_markdown({"steps": {"none": {"ok": cell, "all": cell}, "kv": {"all": cell}},
                                 "episodes": {"none": cell, "kv": cell}})  # fmt: skip
    assert "| none | ok | 3 |" in episodes and "| kv | all | 3 |" in episodes and "success" in episodes
    assert set(EPISODE_METRICS) <= set(cell)
