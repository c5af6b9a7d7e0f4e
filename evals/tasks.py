"""The synthetic VQA task suite: pictures whose answers a model can only give by looking, deterministic per seed.

Five categories, each a stream of ``Sample`` s (a conversation of turns holding images and text, then a question
with a short expected answer):

- ``perception``: colour, shape or count of objects in a rendered scene;
- ``reasoning``: spatial relations between two objects ("is the red circle left of the blue square?") and
  comparing two scenes;
- ``agentic``: a rendered UI panel (a status badge, a form field, buttons) and a text policy with a mutable field
  (``account_role``); the answer is one tool call (``click(approve)``, ``escalate(ticket)``, ...) gated by both;
- ``trajectory``: 2-6 screens across turns; the question is about an earlier one, screens re-appear at new
  positions;
- ``multihop`` (``evals/multihop.py``): 3-5 panels shown in separate turns; the answer binds facts from two or
  more of them (same badge colour on screens i and j, how many showed a filled field, which first showed X).

Every picture is 256 x 256 px (64 language-model tokens per image in both small checkpoints; ``evals/pictures.py``).
**Splits are by picture content**: a picture is held out or not by a hash of its pixels
(``mmkv.synthetic.picture_split``), and a sample of a split shows only pictures of that split, so no held-out
picture appears in any training sample, whatever the seeds. Samples without pictures (``agentic_text``, the
training-only text gate) are split by a hash of their content. A user's own JSONL (``{"images": [paths],
"question": ..., "answer": ...}`` per line) loads as ``Sample`` s too.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from evals.multihop import multihop
from evals.pictures import (
    SceneObject,
    panel_in_split,
    random_objects,
    scene_in_split,
)
from evals.sample import Generated, Sample, Turn
from mmkv.synthetic import Split

__all__ = [
    "AGENTIC_FIELD",
    "AGENTIC_POLICY",
    "AGENTIC_QUESTION",
    "CATEGORIES",
    "TRAINING_CATEGORIES",
    "add_turns",
    "agentic_answer",
    "iter_samples",
    "load_jsonl",
    "make_samples",
    "normalise_answer",
    "sample_session",
]

CATEGORIES = ("perception", "reasoning", "agentic", "trajectory", "multihop")  # the VQA suite
TRAINING_CATEGORIES = (*CATEGORIES, "agentic_text")  # + the agentic task with the gate said in words
_Object = SceneObject  # the name app/trajectory.py imports


def _colour_question(o: SceneObject) -> tuple[str, str]:
    return f"What colour is the {o.shape}? Answer with one word.", o.colour


def _shape_question(o: SceneObject) -> tuple[str, str]:
    return f"What shape is the {o.colour} object? Answer with one word.", o.shape


def _count_question(objects: list[SceneObject]) -> tuple[str, str]:
    return "How many objects are there? Answer with a number.", str(len(objects))


def _relation_question(x: SceneObject, relation: str, y: SceneObject) -> tuple[str, str]:
    truth = x.col < y.col if relation == "left of" else x.row < y.row
    return (
        f"Is the {x.colour} {x.shape} {relation} the {y.colour} {y.shape}? Answer yes or no.",
        "yes" if truth else "no",
    )


def _screen_question(obj: SceneObject, kind: str, screen: int) -> tuple[str, str]:
    question = f"What {kind} was the object on screen {screen + 1}? Answer with one word."
    return question, obj.colour if kind == "colour" else obj.shape


def _scene_questions(objects: list[SceneObject]) -> list[tuple[str, str]]:
    """Every perception question a scene of ``objects`` answers: each object's colour (by its shape, where the
    shape is unique), its shape (by its colour, where unique), and the count."""
    out = [_colour_question(o) for o in objects if sum(p.shape == o.shape for p in objects) == 1]
    out += [_shape_question(o) for o in objects if sum(p.colour == o.colour for p in objects) == 1]
    return [*out, _count_question(objects)]


def _others(pairs: list[tuple[str, str]], question: str) -> tuple[tuple[str, str], ...]:
    """``pairs`` without ``question`` (a generator's ``also``)."""
    return tuple(p for p in pairs if p[0] != question)


def _perception(rng: random.Random, split: Split) -> Generated:
    objects = random_objects(rng, rng.randint(1, 4))
    kind = rng.choice(["colour", "shape", "count"])
    target = rng.choice(objects)
    if kind == "colour" and sum(o.shape == target.shape for o in objects) == 1:
        question, answer = _colour_question(target)
    elif kind == "shape" and sum(o.colour == target.colour for o in objects) == 1:
        question, answer = _shape_question(target)
    else:
        question, answer = _count_question(objects)
    turns = [Turn((scene_in_split(objects, rng, split),), "Look at this picture.")]
    return "", turns, question, answer, _others(_scene_questions(objects), question)


def _reasoning(rng: random.Random, split: Split) -> Generated:
    if rng.random() < 0.7:
        a, b = random_objects(rng, 2)
        relation = rng.choice(["left of", "above"])
        scene = scene_in_split([a, b], rng, split)
        question, answer = _relation_question(a, relation, b)
        pairs = [_relation_question(x, r, y) for x, y in ((a, b), (b, a)) for r in ("left of", "above")]
        turns = [Turn((scene,), "Look at this picture.")]
        return "", turns, question, answer, _others(pairs, question)
    first, second = rng.randint(1, 4), rng.randint(1, 4)
    scenes = tuple(scene_in_split(random_objects(rng, k), rng, split) for k in (first, second))
    answer = "first" if first > second else "second" if second > first else "same"
    question = "Which picture has more objects? Answer first, second or same."
    return "", [Turn(scenes, "Here are two pictures.")], question, answer, ()


AGENTIC_FIELD = "account_role"  # the policy's mutable field (a ``{role}`` placeholder in AGENTIC_POLICY)
AGENTIC_POLICY = (
    "Policy. account_role: {role}. If the status badge is red: an admin answers click(approve), anyone else "
    "answers escalate(ticket). If the badge is green: answer click(submit) when the form field is filled, "
    "else fill(field)."
)
AGENTIC_QUESTION = "What is the next action? Answer with one tool call."


def agentic_answer(role: str, badge: str, field_filled: bool) -> str:
    """The tool call the policy prescribes."""
    if badge == "alert":
        return "click(approve)" if role == "admin" else "escalate(ticket)"
    return "click(submit)" if field_filled else "fill(field)"


def describe_screen(badge: str, field_filled: bool, ticket: int) -> str:
    """The text-only gate: the screen's state said in words instead of shown (the ticket number makes samples
    distinct, so both splits hold every combination)."""
    colour = "red" if badge == "alert" else "green"
    field = "a filled" if field_filled else "an empty"
    return f"Ticket {ticket}. The screen shows a {colour} status badge and {field} form field."


def _agentic(rng: random.Random, split: Split, gate: str = "screen") -> Generated:
    """A policy (``account_role`` field) and the screen's state, shown (``gate="screen"``) or said in words
    (``gate="text"``); 30% of samples then announce a new role in an erratum line (a system turn), which the
    answer must follow."""
    from mmkv.text.erratum import erratum_line

    role = rng.choice(["admin", "viewer"])
    badge = rng.choice(["alert", "ok"])
    filled = rng.random() < 0.5
    if gate == "screen":
        turns = [Turn((panel_in_split(badge, filled, rng, split),), "Here is the screen.")]
    else:
        turns = [Turn((), describe_screen(badge, filled, rng.randint(100, 999)))]
    system = AGENTIC_POLICY.format(role=role)
    if rng.random() < 0.3:
        role = rng.choice(["admin", "viewer"])  # the current value; may equal the old one
        turns.append(Turn((), erratum_line(AGENTIC_FIELD, role), role="system"))
    return system, turns, AGENTIC_QUESTION, agentic_answer(role, badge, filled), ()


def _trajectory(rng: random.Random, split: Split) -> Generated:
    num = rng.randint(2, 6)
    shown: list[tuple[SceneObject, Image.Image]] = []
    pool: list[tuple[SceneObject, Image.Image]] = []
    for _ in range(num):
        if pool and rng.random() < 0.3:  # an earlier screen re-appears (the same picture)
            shown.append(rng.choice(pool))
        else:
            obj = random_objects(rng, 1)[0]
            pool.append((obj, scene_in_split([obj], rng, split)))
            shown.append(pool[-1])
    turns = [Turn((image,), f"Screen {i + 1}.") for i, (_, image) in enumerate(shown)]
    target = rng.randrange(num)
    kind = rng.choice(["colour", "shape"])
    question, answer = _screen_question(shown[target][0], kind, target)
    pairs = [_screen_question(o, k, i) for i, (o, _) in enumerate(shown) for k in ("colour", "shape")]
    return "", turns, question, answer, _others(pairs, question)


def _generators() -> dict:
    return {
        "perception": _perception,
        "reasoning": _reasoning,
        "agentic": _agentic,
        "trajectory": _trajectory,
        "multihop": multihop,
        "agentic_text": lambda rng, split: _agentic(rng, split, gate="text"),
    }


def _content_digest(system: str, turns: list[Turn], question: str, answer: str) -> str:
    h = hashlib.sha256(b"mmkv-task-v3\0")
    h.update(f"{system}\0{question}\0{answer}\0".encode())
    for turn in turns:
        h.update(f"{turn.role}\0{turn.text}\0{len(turn.images)}\0".encode())
        for image in turn.images:
            h.update(image.tobytes())
    return h.hexdigest()


def _text_split(digest: str) -> Split:
    """The split of a sample without pictures, by its content digest (about 20% held out)."""
    return "heldout" if int(digest[:8], 16) % 5 == 0 else "train"


def iter_samples(category: str, seed: int, split: str) -> Iterator[Sample]:
    """An endless deterministic stream of ``category`` samples of ``split`` ("train" or "heldout"); the pictures
    of every sample lie in ``split`` (text-only samples: the sample's digest does). May repeat a sample."""
    generators = _generators()
    if category not in generators:
        raise ValueError(f"unknown category {category!r}; choose from {TRAINING_CATEGORIES}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{category}/{split}/{seed}")
    for _ in range(200_000):  # far more draws than any split of any category needs
        system, turns, question, answer, also = generators[category](rng, split)
        digest = _content_digest(system, turns, question, answer)
        if any(turn.images for turn in turns) or _text_split(digest) == split:
            yield Sample(category, system, tuple(turns), question, answer, digest, also)
    raise RuntimeError(f"the {category} generator ran out of distinct samples")


def make_samples(
    category: str, n: int, seed: int = 0, split: str = "heldout", unique: bool = True
) -> list[Sample]:
    """The first ``n`` samples of the stream (distinct by digest when ``unique``)."""
    out, seen = [], set()
    for sample in iter_samples(category, seed, split):
        if unique and sample.digest in seen:
            continue
        seen.add(sample.digest)
        out.append(sample)
        if len(out) == n:
            return out
    return out


def sample_session(handle, sample: Sample, **session_kwargs):
    """A fresh ``mmkv.Session`` over ``handle`` holding ``sample``'s conversation: the system text, then each
    turn's images and text (the question is not added). ``session_kwargs`` go to ``Session``."""
    import mmkv

    session = mmkv.Session(handle, **session_kwargs)
    if sample.system:
        session.add_text(sample.system, role="system")
    add_turns(session, sample)
    return session


def add_turns(session, sample: Sample) -> None:
    """Append ``sample``'s turns (images, then text, each turn as its role) to ``session``."""
    for turn in sample.turns:
        for image in turn.images:
            session.add_image(image)
        if turn.text:
            session.add_text(turn.text, role=turn.role)


def normalise_answer(text: str) -> str:
    """First line, lower case, surrounding spaces and a trailing full stop removed."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.strip().lower().rstrip(".").strip()


def load_jsonl(path: str | Path) -> list[Sample]:
    """Samples from a JSONL file: one object per line with ``images`` (paths, relative to the file), ``question``
    and ``answer``; optional ``system`` and ``text`` (said with the images). Raises ``ValueError`` naming the
    line on a malformed record."""
    from mmkv.images import load_image

    path = Path(path)
    samples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            images = tuple(load_image(path.parent / p) for p in record.get("images", []))
            turn = Turn(images, str(record.get("text", "")))
            question, answer = str(record["question"]), str(record["answer"])
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: bad record ({exc})") from exc
        digest = _content_digest(str(record.get("system", "")), [turn], question, answer)
        samples.append(Sample("custom", str(record.get("system", "")), (turn,), question, answer, digest))
    return samples
