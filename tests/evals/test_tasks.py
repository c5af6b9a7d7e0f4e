"""The synthetic task suite: deterministic, split by picture content, answers that follow from the pictures."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from evals.pictures import SHAPES
from evals.tasks import (
    CATEGORIES,
    TRAINING_CATEGORIES,
    agentic_answer,
    load_jsonl,
    make_samples,
    normalise_answer,
)
from mmkv.synthetic import COLOURS, FIELD_FILL, picture_digest, picture_split


@pytest.mark.parametrize("category", CATEGORIES)
def test_generation_is_deterministic(category):
    """The same seed gives the same samples, pixels included; another seed gives others."""
    first, again, other = (make_samples(category, 20, seed=s) for s in (0, 0, 1))
    assert [s.digest for s in first] == [s.digest for s in again]
    assert first[0].turns[0].images[0].tobytes() == again[0].turns[0].images[0].tobytes()
    assert {s.digest for s in first} != {s.digest for s in other}


@pytest.mark.parametrize("category", TRAINING_CATEGORIES)
def test_splits_are_disjoint_across_seeds(category):
    """No held-out sample equals a training sample, whatever the seeds."""
    heldout = {s.digest for s in make_samples(category, 100, seed=0, split="heldout")}
    train = {s.digest for seed in (0, 1) for s in make_samples(category, 300, seed=seed, split="train")}
    assert len(heldout) == 100 and not heldout & train


@pytest.mark.parametrize("category", CATEGORIES)
def test_the_split_is_by_picture_content(category):
    """Every picture of a held-out sample hashes to the held-out split, every training picture to the training
    split: no held-out picture appears in any training sample, of any category or seed."""
    heldout = {
        picture_digest(i) for s in make_samples(category, 60, seed=3, split="heldout") for i in s.images
    }
    train = {
        picture_digest(i)
        for d in (0, 3)
        for s in make_samples(category, 120, seed=d, split="train")
        for i in s.images
    }
    assert {picture_split(d) for d in heldout} == {"heldout"} and {picture_split(d) for d in train} == {
        "train"
    }
    assert not heldout & train


def test_every_picture_is_256_px():
    """256 x 256 px: 64 language-model tokens in both small checkpoints (tests/training checks the count)."""
    for category in CATEGORIES:
        assert {im.size for s in make_samples(category, 20) for im in s.images} == {(256, 256)}


def test_every_category_has_several_answers_and_images():
    """Each category mixes answers (no single answer above 60%) and every sample shows at least one image."""
    for category in CATEGORIES:
        samples = make_samples(category, 200)
        answers = [s.answer for s in samples]
        assert max(answers.count(a) for a in set(answers)) / len(answers) < 0.6
        assert all(s.num_images >= 1 for s in samples)
    assert {s.num_images for s in make_samples("trajectory", 200)} == {2, 3, 4, 5, 6}
    assert {s.num_images for s in make_samples("multihop", 200)} == {3, 4, 5}


def _panel_state(image) -> tuple[bool, bool]:
    """(badge red, field filled) read off a panel's pixels."""
    pixels = np.asarray(image).reshape(-1, 3)
    return bool((pixels == COLOURS["red"]).all(1).any()), bool((pixels == FIELD_FILL).all(1).any())


def _multihop_truth(question: str, states: list[tuple[bool, bool]]) -> tuple[str, str]:
    """(the question's kind, its answer) worked out from the panels' states as read off their pixels."""
    if question.startswith("Is the status badge on screen"):
        i, j = (int(w) - 1 for w in question.replace("?", "").split() if w.isdigit())
        assert j - i >= 2
        return "same", "yes" if states[i][0] == states[j][0] else "no"
    if question.startswith("How many screens"):
        return "count", str(sum(filled for _, filled in states))
    axis = 0 if "red status badge" in question else 1
    return ("first red", "first filled")[axis], str(1 + [s[axis] for s in states].index(True))


def test_multihop_answers_bind_facts_from_several_screens():
    """Each multihop answer follows from the panels' pixels, read screen by screen; every kind is asked, the
    compared screens are never neighbours, and no single screen decides a count."""
    kinds = set()
    for sample in make_samples("multihop", 120):
        states = [_panel_state(turn.images[0]) for turn in sample.turns]
        assert [t.text for t in sample.turns] == [f"Screen {i + 1}." for i in range(len(states))]
        kind, answer = _multihop_truth(sample.question, states)
        assert sample.answer == answer
        kinds.add(kind)
    assert kinds == {"same", "count", "first red", "first filled"}


def test_the_other_questions_a_sample_answers_follow_from_its_pictures():
    """``Sample.also`` (training's dense supervision) holds only true answers: multihop's from the panels' pixels,
    trajectory's colours from each screen's pixels (and a screen shown twice answers alike), perception's and
    reasoning's from the scene; never the sample's own question, none twice; the agentic task has none."""
    for sample in make_samples("multihop", 60):
        states = [_panel_state(turn.images[0]) for turn in sample.turns]
        assert sample.also and sample.question not in [q for q, _ in sample.also]
        assert all(_multihop_truth(q, states)[1] == a for q, a in sample.also)
        assert len({q for q, _ in sample.also}) == len(sample.also)
    for sample in make_samples("trajectory", 60):
        assert len(sample.also) == 2 * len(sample.turns) - 1
        for question, answer in sample.also:
            k = int(question.split("screen ")[1].split("?")[0]) - 1
            pixels = np.asarray(sample.turns[k].images[0]).reshape(-1, 3)
            if " colour " in question:
                assert (pixels == COLOURS[answer]).all(1).any()
            else:
                assert answer in SHAPES
    for sample in make_samples("perception", 60):
        pairs = dict([*sample.also, (sample.question, sample.answer)])
        count = int(pairs["How many objects are there? Answer with a number."])
        pixels = np.asarray(sample.turns[0].images[0]).reshape(-1, 3)
        for question, answer in pairs.items():
            if question.startswith("What colour"):
                assert (pixels == COLOURS[answer]).all(1).any()
        assert sum(q.startswith("What colour") for q in pairs) <= count
    relation = re.compile(r"Is the (\w+ \w+) (left of|above) the (\w+ \w+)\?")
    for sample in make_samples("reasoning", 60):
        facts = {relation.match(q).groups(): a for q, a in [*sample.also, (sample.question, sample.answer)]
                 if relation.match(q)}  # fmt: skip
        assert len(facts) in (0, 4)
        for (x, rel, y), answer in facts.items():
            assert not (answer == "yes" and facts[(y, rel, x)] == "yes")  # never both ways
    assert all(not s.also for s in make_samples("agentic", 20))


def test_perception_count_matches_the_pixels():
    """For count questions, the number of coloured blobs in the picture equals the answer."""
    for sample in make_samples("perception", 60):
        if not sample.question.startswith("How many"):
            continue
        pixels = np.asarray(sample.turns[0].images[0]).reshape(-1, 3)
        colours_present = sum(bool((pixels == c).all(1).any()) for c in COLOURS.values())
        assert colours_present <= int(sample.answer) <= 4


def test_agentic_answers_follow_the_policy_and_the_badge():
    """The tool call depends on the role in the system text and on the badge colour in the screenshot."""
    assert agentic_answer("admin", "alert", False) == "click(approve)"
    assert agentic_answer("viewer", "alert", True) == "escalate(ticket)"
    assert agentic_answer("viewer", "ok", True) == "click(submit)"
    updates = 0
    for sample in make_samples("agentic", 60):
        role = "admin" if "account_role: admin" in sample.system else "viewer"
        if len(sample.turns) == 2:  # an erratum overrides the policy's role
            update = sample.turns[1]
            assert update.role == "system" and update.text.startswith("[STATE UPDATE] account_role has just")
            role = "admin" if "changed to admin;" in update.text else "viewer"
            updates += 1
        pixels = np.asarray(sample.turns[0].images[0]).reshape(-1, 3)
        badge = "alert" if (pixels == COLOURS["red"]).all(1).any() else "ok"
        field_filled = bool((pixels == (40, 40, 40)).all(1).any())
        assert sample.answer == agentic_answer(role, badge, field_filled)
    assert 5 < updates < 40


def test_text_gated_agentic_samples_say_the_screen_in_words():
    """``agentic_text`` (training only): the same policy, the screen described instead of shown."""
    for sample in make_samples("agentic_text", 30):
        assert sample.num_images == 0
        text = sample.turns[0].text
        role = "admin" if "account_role: admin" in sample.system else "viewer"
        if len(sample.turns) == 2:
            role = "admin" if "changed to admin;" in sample.turns[1].text else "viewer"
        badge = "alert" if "a red status badge" in text else "ok"
        assert sample.answer == agentic_answer(role, badge, "a filled form field" in text)


def test_normalise_answer():
    """First line, lower case, trailing full stop and spaces removed."""
    assert normalise_answer("  Red.\nbecause") == "red"
    assert normalise_answer("click(approve)") == "click(approve)"
    assert normalise_answer("") == ""


def test_user_jsonl_loads_and_bad_records_name_their_line(tmp_path):
    """A JSONL of image paths, questions and answers loads; a record without an answer names its line."""
    make_samples("perception", 1)[0].turns[0].images[0].save(tmp_path / "a.png")
    good = tmp_path / "tasks.jsonl"
    good.write_text(json.dumps({"images": ["a.png"], "question": "Colour?", "answer": "red"}) + "\n")
    (sample,) = load_jsonl(good)
    assert sample.category == "custom" and sample.num_images == 1 and sample.answer == "red"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"images": ["a.png"], "question": "Colour?"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(bad)
