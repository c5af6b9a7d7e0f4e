"""What an eval's accuracy is read against: the chance level of its answers, and the reference arm.

Reuse can only break what a model does: a model at chance on a category has nothing to lose there, so an arm's
agreement with full recompute says nothing about reuse on it. Every table therefore shows, per cell:

- ``chance``: the accuracy of the **best blind guesser**, one that never looks at an image or a screen but knows
  each question's *form* (``question_form``: the question with its colour, shape and number words masked, so
  ``"What colour is the circle? ..."`` and ``"What colour is the square? ..."`` are one form) and answers every
  question of a form with that form's most common expected answer *in the cell itself*. Estimated on the answers
  being scored, it is the guesser's best case, so "above chance" is claimed conservatively;
- ``at_chance``: whether the reference arm's accuracy (``none`` in the VQA eval) cannot be told from chance: the
  lower end of its Wilson 95% interval is at or below ``chance``. Tables and the README mark such a category;
- ``delta_accuracy``: an arm's accuracy minus the reference's on the same samples (paired: a sample counts once in
  each), with a seeded bootstrap 95% interval over samples.

All functions here are pure: they read records and return new values, and change none of their arguments.

>>> question_form("What colour is the circle? Answer with one word.")
'What colour is the <shape>? Answer with one word.'
>>> rows = [{"question": f"Is the {c} circle left of it?", "expected": a} for c, a in [("red", "yes"),
...         ("blue", "yes"), ("green", "no"), ("red", "yes")]]
>>> chance_level(rows)
0.75
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from evals.pictures import SHAPES
from evals.report import Metric
from mmkv.synthetic import COLOURS

__all__ = [
    "DELTA", "at_chance", "attach_reference", "chance_level", "mark_chance", "question_form",
]  # fmt: skip

_MASKS = (  # (pattern, placeholder), applied in order; whole words only
    (re.compile(r"\b(" + "|".join(COLOURS) + r")\b", re.IGNORECASE), "<colour>"),
    (re.compile(r"\b(" + "|".join(SHAPES) + r")\b", re.IGNORECASE), "<shape>"),
    (re.compile(r"\d+"), "<n>"),
)


def question_form(question: str) -> str:
    """``question`` with colour words, shape words and numbers masked: what a guesser that never sees the
    picture can tell one question from another by.

    >>> question_form("Do screens 2 and 4 show the same badge colour? Answer yes or no.")
    'Do screens <n> and <n> show the same badge colour? Answer yes or no.'
    """
    for pattern, placeholder in _MASKS:
        question = pattern.sub(placeholder, question)
    return question


def chance_level(
    cell: Sequence[dict], form: Callable[[dict], str] | None = None, answer_key: str = "expected"
) -> float | None:
    """The best blind guesser's accuracy on ``cell``: per form (``form(record)``; by default ``question_form`` of
    the record's ``"question"``, or one form for all when records have none), the share of the form's most common
    ``answer_key`` value, summed over forms and divided by the cell's size. ``None`` when the records carry no
    expected answer (results written before it was recorded) or the cell is empty.

    >>> chance_level([{"expected": "a"}, {"expected": "b"}, {"expected": "a"}, {"expected": "c"}])
    0.5
    """
    if not cell or any(answer_key not in r for r in cell):
        return None
    if form is None:
        form = (
            (lambda r: question_form(r["question"])) if all("question" in r for r in cell) else (lambda r: "")
        )
    by_form: dict[str, Counter] = {}
    for r in cell:
        by_form.setdefault(form(r), Counter())[str(r[answer_key])] += 1
    return sum(counts.most_common(1)[0][1] for counts in by_form.values()) / len(cell)


def at_chance(accuracy: dict, chance: float | None) -> bool | None:
    """Whether ``accuracy`` (an estimate dict with ``"low"``) cannot be told from ``chance``: its interval
    reaches down to chance or below. ``None`` when there is no chance level.

    >>> at_chance({"value": 0.55, "low": 0.48, "high": 0.62}, 0.5), at_chance({"value": 0.9, "low": 0.85}, 0.5)
    (True, False)
    """
    return None if chance is None else bool(accuracy["low"] <= chance)


def attach_reference(
    records: Sequence[dict], reference: str = "none", arm_key: str = "arm", sample_key: str = "digest"
) -> list[dict]:
    """New records, each with ``"reference_correct"``: whether the ``reference`` arm answered the same sample
    (``sample_key``) correctly. Records whose sample has no reference record are returned without it. The input
    records are not changed.

    >>> rows = [{"arm": "none", "digest": "s", "correct": False}, {"arm": "kv", "digest": "s", "correct": True}]
    >>> [r["reference_correct"] for r in attach_reference(rows)]
    [False, False]
    """
    truth = {
        r[sample_key]: bool(r["correct"]) for r in records if r[arm_key] == reference and sample_key in r
    }
    return [
        r | {"reference_correct": truth[r[sample_key]]} if r.get(sample_key) in truth else dict(r)
        for r in records
    ]


def _mean_difference(arm: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return arm.mean(-1) - reference.mean(-1)


DELTA = Metric(("correct", "reference_correct"), _mean_difference)  # paired accuracy difference (bootstrap)


def mark_chance(
    table: dict[str, dict],
    records: Sequence[dict],
    group_key: str,
    reference: str = "none",
    form: Callable[[dict], str] | None = None,
) -> dict[str, dict]:
    """A copy of ``table`` (``cells``' ``{arm: {group: cell}}``) in which every cell of a group also holds
    ``chance`` (``chance_level`` of the ``reference`` arm's records of that group; ``"all"``: of all of them),
    ``reference_accuracy`` (the reference cell's ``accuracy``) and ``at_chance``. Groups the reference arm did
    not run are left as they were; ``table`` is not changed.
    """
    ref = [r for r in records if r.get("arm") == reference]
    if reference not in table:
        return {arm: dict(groups) for arm, groups in table.items()}
    marks: dict[str, dict] = {}
    for group, cell in table[reference].items():
        chosen = [r for r in ref if group == "all" or r[group_key] == group]
        chance = chance_level(chosen, form)
        if "accuracy" in cell:
            marks[group] = {
                "chance": chance,
                "reference_accuracy": cell["accuracy"],
                "at_chance": at_chance(cell["accuracy"], chance),
            }
    return {
        arm: {group: cell | marks.get(group, {}) for group, cell in groups.items()}
        for arm, groups in table.items()
    }

