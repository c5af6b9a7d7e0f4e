"""bench/serve_host.py: a request's host time per turn, and with --parts where it goes, on the tiny model."""

from __future__ import annotations

import math

import pytest

from bench.serve_host import run

pytestmark = pytest.mark.bench


def test_host_time_is_reported_per_turn_and_the_parts_add_up():
    """Twelve turns of one agent: host and forward ms for every turn (forward > 0: the clock sees the model),
    the three reported turns that exist; the parts are the server's named steps plus a remainder, and they add
    up to the mean host ms of the turns after the tenth (the steps are timed, not estimated)."""
    result = run("tiny-qwen3-vl", turns=12, agents=1, window=3, max_tokens=2, parts=True)
    assert len(result["host_ms_by_turn"]) == len(result["forward_ms_by_turn"]) == 12
    assert set(result["host_ms"]) == {"2", "10"} and all(f > 0 for f in result["forward_ms_by_turn"])
    parts = result["parts_ms"]
    model = "[model thread] "
    assert {"new images (decode, digest, preprocess)", "layout", model + "pool checkout",
            model + "decode loop (choose, text)", model + "prefill (plan, splice, mask, store writes)"} <= set(parts)  # fmt: skip
    assert 0 < result["model_thread_ms"] < result["parts_host_ms"]
    assert all(ms >= 0 for name, ms in parts.items() if not name.startswith("JSON"))
    assert parts["new images (decode, digest, preprocess)"] > 0 and parts["layout"] > 0
    assert math.isclose(sum(parts.values()), result["parts_host_ms"], abs_tol=0.01)  # each rounded to 1 us
