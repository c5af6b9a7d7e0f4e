"""Chance levels and the paired difference from the reference arm (``evals/baselines.py``), and how the VQA
aggregate and table use them. Pure: no model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evals.baselines import at_chance, attach_reference, chance_level, mark_chance, question_form
from evals.pictures import SHAPES
from evals.report import vqa_markdown, wilson
from evals.tasks import CATEGORIES, make_samples
from evals.vqa import aggregate
from mmkv.synthetic import COLOURS


def test_question_form_masks_every_colour_shape_and_number_and_nothing_else():
    """Questions that differ only in what the picture decides are one form; other words are kept."""
    forms = {
        question_form(f"Is the {c} {s} left of box {k}?") for c in COLOURS for s in SHAPES for k in (1, 23)
    }
    assert forms == {"Is the <colour> <shape> left of box <n>?"}
    assert (
        question_form("What COLOUR is the Circle?") == "What COLOUR is the <shape>?"
    )  # case-blind, whole words
    assert question_form("Redo the squares, reddish") == "Redo the squares, reddish"
    assert question_form("Is it left of it?") != question_form("Is it above it?")


def _rows(pairs):
    return [{"question": q, "expected": a} for q, a in pairs]


def test_chance_is_the_best_guess_per_question_form():
    """Each form is answered with its most common answer: a question that gives its answer away is at 1.0,
    forms are counted apart, and order does not matter."""
    rows = _rows(
        [("Is it left of it?", "yes")] * 3 + [("Is it above it?", "no")] * 2 + [("Is it above it?", "yes")]
    )
    assert chance_level(rows) == pytest.approx(5 / 6)
    assert chance_level(list(reversed(rows))) == chance_level(rows)
    colour = _rows((f"What colour is the {s}?", c) for s, c in zip(SHAPES, COLOURS, strict=False))
    assert chance_level(colour) == pytest.approx(
        1 / len(colour)
    )  # the shape word does not give a colour away
    assert chance_level(_rows([("Same?", "yes")] * 4)) == 1.0
    assert chance_level([{"expected": a} for a in "aabc"]) == 0.5  # no question: one form
    assert chance_level([]) is None and chance_level([{"question": "q"}]) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["q1", "q2", "What colour is the circle?"]), st.sampled_from("abc")),
                min_size=1, max_size=40))  # fmt: skip
def test_chance_is_between_a_constant_guess_and_one(pairs):
    """Knowing the form never does worse than one answer for all, and never better than always right."""
    rows = _rows(pairs)
    constant = max(sum(a == b for _, b in pairs) for a in "abc") / len(pairs)
    assert constant - 1e-12 <= chance_level(rows) <= 1.0


def test_at_chance_is_the_interval_reaching_chance():
    """The boundary counts as at chance; no chance level gives no verdict."""
    e = wilson(60, 100)
    assert at_chance(e.__dict__, e.low) is True and at_chance(e.__dict__, e.low - 1e-9) is False
    assert at_chance(e.__dict__, None) is None


def test_every_suite_category_has_a_chance_level_well_below_the_target():
    """The held-out suite's answers are not guessable: a 0.90 target is far above every category's chance."""
    for category in CATEGORIES:
        samples = make_samples(category, 120, seed=7411)
        chance = chance_level(_rows((s.question, s.answer) for s in samples))
        assert 0.15 < chance < 0.6, (category, chance)


def test_reference_is_paired_by_sample_not_by_order():
    """Shuffled records are paired by digest; inputs are not changed; a sample without a reference stays as is."""
    rows = [{"arm": "none", "digest": str(i), "correct": i % 2 == 0} for i in range(6)]
    rows += [{"arm": "kv", "digest": str(i), "correct": True} for i in range(7)]
    random.Random(3).shuffle(rows)
    before = [dict(r) for r in rows]
    paired = attach_reference(rows)
    assert rows == before
    for r in paired:
        if r["digest"] == "6":
            assert "reference_correct" not in r
        else:
            assert r["reference_correct"] == (int(r["digest"]) % 2 == 0)


def _records(category: str, n: int, none_right: int, kv_right: int, answers: str) -> list[dict]:
    """none and kv records of ``n`` samples of one question form, expected answers cycling through ``answers``."""
    out = []
    for i in range(n):
        base = {"category": category, "digest": f"{category}{i}", "question": "Which one?",
                "expected": answers[i % len(answers)], "agree": True, "cosine": 1.0, "ttft_s": 0.1,
                "none_ttft_s": 0.1, "prompt_tokens": 10, "reused_tokens": 0, "min_abs_shift": None,
                "max_abs_shift": None}  # fmt: skip
        out.append(base | {"arm": "none", "correct": i < none_right})
        out.append(base | {"arm": "kv", "correct": i < kv_right})
    return out


def test_the_vqa_aggregate_marks_a_category_at_chance_and_pairs_the_difference():
    """A category answered at its chance level is marked in every arm's row; one far above is not; the
    accuracy difference is the paired one, with an interval around it."""
    records = _records("guessy", 100, 27, 25, "abcd") + _records("solid", 100, 95, 90, "abcd")
    table = aggregate(records)
    for arm in ("none", "kv"):
        assert table[arm]["guessy"]["chance"] == 0.25 and table[arm]["guessy"]["at_chance"] is True
        assert table[arm]["solid"]["at_chance"] is False
        assert table[arm]["solid"]["reference_accuracy"]["value"] == 0.95
    delta = table["kv"]["solid"]["delta_accuracy"]
    assert (
        delta["value"] == pytest.approx(-0.05)
        and delta["low"] <= -0.05 <= delta["high"]
        and delta["high"] < 0
    )
    assert table["none"]["solid"]["delta_accuracy"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    rows = vqa_markdown(table).splitlines()
    assert sum("guessy (at chance)" in r for r in rows) == 2 and not any(
        "solid (at chance)" in r for r in rows
    )
    assert "| kv | solid | 100 | 0.90 [0.83, 0.94] | -0.05 [" in vqa_markdown(table)


def test_mark_chance_leaves_tables_without_a_reference_alone():
    """No none arm: no marks, and the input table is not changed."""
    table = {"kv": {"a": {"n": 1, "accuracy": {"value": 1.0, "low": 0.2, "high": 1.0}}}}
    marked = mark_chance(table, [{"arm": "kv", "category": "a", "expected": "x"}], "category")
    assert marked == table and marked is not table
