"""bench/edit.py on a tiny model: every strategy interleaved, with what it recomputed and its time range."""

from __future__ import annotations

import pytest

from bench.edit import ARMS, run

pytestmark = pytest.mark.bench


def test_every_strategy_is_timed_with_its_range_and_cost(tiny_by_name):
    rows = run(tiny_by_name["tiny-qwen3-vl"], shots=1, size=224, repeats=2)
    assert len(rows) == len(ARMS) and len({r["strategy"] for r in rows}) == len(ARMS)
    by_name = {r["strategy"]: r for r in rows}
    assert by_name["full"]["fraction"] == 1.0 and by_name["full"]["vs_full"] == 1.0
    assert by_name["in_place"]["recomputed"] < by_name["suffix"]["recomputed"] < by_name["full"]["recomputed"]
    assert by_name["selective k=8 (attention)"]["recomputed"] == by_name["in_place"]["recomputed"] + 8
    for row in rows:
        t = row["edit_ms"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
