"""The ``multihop`` category: questions whose answer binds facts from two or more screens shown apart.

A conversation shows 3-5 UI panels (``mmkv.synthetic.render_panel``: a status badge, red or green, and a form
field, filled or empty), each in a turn of its own ("Screen 1.", "Screen 2.", ...), then asks one of:

- ``same_badge``: "Is the status badge on screen i the same colour as on screen j?" (j >= i + 2: never
  neighbours; yes and no equally likely);
- ``count_filled``: "How many screens showed a filled form field?" (0 to 5);
- ``first_red`` / ``first_filled``: "Which screen first showed a red status badge / a filled form field?" (the
  first index drawn uniformly, so every screen number is an answer; at least one screen qualifies).

One image alone never answers: the model must hold what it read from each screen until the question (where
position-independent reuse is hardest: Kamera, arXiv 2606.23581, finds blind reuse halves multi-hop accuracy).
"""

from __future__ import annotations

import random

from evals.pictures import panel_in_split
from evals.sample import Generated, Turn
from mmkv.synthetic import Split

__all__ = ["KINDS", "all_questions", "multihop"]

KINDS = ("same_badge", "count_filled", "first_red", "first_filled")


COUNT_QUESTION = "How many screens showed a filled form field? Answer with a number."
_WHAT = ("a red status badge", "a filled form field")  # what first_red / first_filled ask about, by axis


def _same_badge_question(i: int, j: int) -> str:
    return f"Is the status badge on screen {i + 1} the same colour as on screen {j + 1}? Answer yes or no."


def _first_question(axis: int) -> str:
    return f"Which screen first showed {_WHAT[axis]}? Answer with a number."


def _states(rng: random.Random, num: int, kind: str) -> tuple[list[tuple[bool, bool]], str, str]:
    """``(is_red, is_filled)`` per screen, the question and its answer."""
    states = [(rng.random() < 0.5, rng.random() < 0.5) for _ in range(num)]
    if kind == "same_badge":
        i = rng.randrange(num - 2)
        j = rng.randrange(i + 2, num)
        same = rng.random() < 0.5
        states[j] = (states[i][0] == same, states[j][1])
        return states, _same_badge_question(i, j), "yes" if same else "no"
    if kind == "count_filled":
        return states, COUNT_QUESTION, str(sum(filled for _, filled in states))
    axis = 0 if kind == "first_red" else 1
    first = rng.randrange(num)
    for k in range(first):
        states[k] = tuple(False if a == axis else v for a, v in enumerate(states[k]))
    states[first] = tuple(True if a == axis else v for a, v in enumerate(states[first]))
    return states, _first_question(axis), str(first + 1)


def all_questions(states: list[tuple[bool, bool]]) -> list[tuple[str, str]]:
    """Every question of every kind that screens of ``states`` answer (``same_badge`` for each pair at least two
    apart; ``first_red`` / ``first_filled`` where some screen qualifies).

    >>> [a for _, a in all_questions([(True, False), (False, False), (True, True)])]
    ['yes', '1', '1', '3']
    """
    num = len(states)
    out = [
        (_same_badge_question(i, j), "yes" if states[i][0] == states[j][0] else "no")
        for i in range(num)
        for j in range(i + 2, num)
    ]
    out.append((COUNT_QUESTION, str(sum(filled for _, filled in states))))
    for axis in (0, 1):
        hits = [k for k, state in enumerate(states) if state[axis]]
        if hits:
            out.append((_first_question(axis), str(hits[0] + 1)))
    return out


def multihop(rng: random.Random, split: Split) -> Generated:
    """One multihop sample: ``(system, turns, question, answer)`` with every panel drawn in ``split``."""
    num = rng.randint(3, 5)
    kind = rng.choice(KINDS)
    states, question, answer = _states(rng, num, kind)
    turns = [
        Turn((panel_in_split("alert" if red else "ok", filled, rng, split),), f"Screen {i + 1}.")
        for i, (red, filled) in enumerate(states)
    ]
    return "", turns, question, answer, tuple(p for p in all_questions(states) if p[0] != question)
