"""bench.timing: arms interleave round by round, in a rotating order, after a warm-up round."""

from __future__ import annotations

import pytest

from bench.timing import Timing, interleave


def test_arms_interleave_in_rotating_order_after_one_warmup_round():
    """Each round runs every arm once; the first arm of round r is arm r mod n; the warm-up round is untimed."""
    calls: list[str] = []
    arms = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    result = interleave(arms, repeats=4)
    assert calls[:3] == ["A", "B", "C"]  # warm-up
    assert calls[3:] == list("ABCBCACABABC")
    assert all(len(result[name].samples) == 4 for name in "ABC")


def test_custom_measure_is_used_and_summarised():
    """A ``measure`` callback supplies the samples; median, min and max come from them."""
    values = iter([9.0, 1.0, 5.0, 3.0])
    result = interleave({"x": lambda: None}, repeats=3, measure=lambda name, fn: next(values))
    assert result["x"].samples == (1.0, 5.0, 3.0)
    assert (result["x"].median, result["x"].min, result["x"].max) == (3.0, 1.0, 5.0)
    assert str(result["x"]) == "3.00 ms [1.00-5.00]"


def test_bad_arguments_are_refused():
    """Zero repeats and empty timings are errors, not empty results."""
    with pytest.raises(ValueError, match="repeats"):
        interleave({"x": lambda: None}, repeats=0)
    with pytest.raises(ValueError, match="at least one sample"):
        Timing(())
