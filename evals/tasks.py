"""The synthetic VQA task suite: pictures whose answers a model can only give by looking, deterministic per seed.

Four categories, each a list of ``Sample`` s (a conversation of turns holding images and text, then a question
with a short expected answer):

- ``perception``: colour, shape or count of objects in a rendered scene;
- ``reasoning``: spatial relations between two objects ("is the red circle left of the blue square?") and
  comparing two scenes;
- ``agentic``: a rendered UI panel (a status badge, a form field, buttons) and a text policy with a mutable field
  (``account_role``); the answer is one tool call (``click(approve)``, ``escalate(ticket)``, ...) gated by both;
- ``trajectory``: 2-6 screens across turns; the question is about an earlier one, screens re-appear at new
  positions.

Splits are disjoint by construction: a sample belongs to ``train`` or ``heldout`` by the parity of a hash of
its content (pixels, texts, answer), so no held-out sample can equal a training one, whatever the seeds.
A user's own JSONL (``{"images": [paths], "question": ..., "answer": ...}`` per line) loads as ``Sample`` s too.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = [
    "CATEGORIES",
    "Sample",
    "Turn",
    "add_turns",
    "load_jsonl",
    "make_samples",
    "normalise_answer",
    "render_scene",
    "sample_session",
]

CATEGORIES = ("perception", "reasoning", "agentic", "trajectory")  # the VQA suite
TRAINING_CATEGORIES = (*CATEGORIES, "agentic_text")  # + the agentic task with the gate said in words
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
CANVAS = (
    96  # scene side in pixels: 3 cells of 32 px, so each cell is one merged vision token of both families
)
GRID = 3  # objects sit in the cells of a GRID x GRID layout
PANEL = 128  # UI panel side in pixels


@dataclass(frozen=True)
class Turn:
    """One turn: images first, then text (either may be empty). A ``system`` turn (text only) is a message of its
    own, e.g. an erratum announcing that a policy field has changed."""

    images: tuple[Image.Image, ...]  # RGB images shown in this turn
    text: str  # what is said after them
    role: str = "user"  # "user" or "system"


@dataclass(frozen=True)
class Sample:
    """A conversation and the answer expected to its last question."""

    category: str  # one of CATEGORIES, or "custom"
    system: str  # system text ("" for none)
    turns: tuple[Turn, ...]  # earlier turns (context)
    question: str  # the final question
    answer: str  # the expected short answer
    digest: str  # content hash (pixels, texts, answer): the sample's identity

    @property
    def num_images(self) -> int:
        """Images across all turns."""
        return sum(len(t.images) for t in self.turns)


@dataclass(frozen=True)
class _Object:
    shape: str
    colour: str
    row: int
    col: int


def render_scene(objects: list[_Object], background: tuple[int, int, int] = (245, 245, 245)) -> Image.Image:
    """A CANVAS x CANVAS RGB scene with each object drawn in its grid cell."""
    image = Image.new("RGB", (CANVAS, CANVAS), background)
    draw = ImageDraw.Draw(image)
    cell = CANVAS // GRID
    for obj in objects:
        x0, y0 = obj.col * cell + 5, obj.row * cell + 5
        x1, y1 = x0 + cell - 10, y0 + cell - 10
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        elif obj.shape == "square":
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def _random_objects(rng: random.Random, count: int, distinct: bool = True) -> list[_Object]:
    cells = rng.sample([(r, c) for r in range(GRID) for c in range(GRID)], count)
    kinds = [(s, c) for s in SHAPES for c in COLOURS]
    chosen = rng.sample(kinds, count) if distinct else [rng.choice(kinds) for _ in range(count)]
    return [
        _Object(shape, colour, row, col) for (shape, colour), (row, col) in zip(chosen, cells, strict=True)
    ]


def _perception(rng: random.Random) -> tuple[str, list[Turn], str, str]:
    objects = _random_objects(rng, rng.randint(1, 4))
    scene = render_scene(objects)
    kind = rng.choice(["colour", "shape", "count"])
    target = rng.choice(objects)
    if kind == "colour":
        question, answer = f"What colour is the {target.shape}? Answer with one word.", target.colour
        if sum(o.shape == target.shape for o in objects) > 1:
            question, answer = "How many objects are there? Answer with a number.", str(len(objects))
    elif kind == "shape":
        question, answer = f"What shape is the {target.colour} object? Answer with one word.", target.shape
        if sum(o.colour == target.colour for o in objects) > 1:
            question, answer = "How many objects are there? Answer with a number.", str(len(objects))
    else:
        question, answer = "How many objects are there? Answer with a number.", str(len(objects))
    return "", [Turn((scene,), "Look at this picture.")], question, answer


def _reasoning(rng: random.Random) -> tuple[str, list[Turn], str, str]:
    if rng.random() < 0.7:
        a, b = _random_objects(rng, 2)
        relation = rng.choice(["left of", "above"])
        truth = a.col < b.col if relation == "left of" else a.row < b.row
        if (relation == "left of" and a.col == b.col) or (relation == "above" and a.row == b.row):
            truth = False
        scene = render_scene([a, b])
        question = f"Is the {a.colour} {a.shape} {relation} the {b.colour} {b.shape}? Answer yes or no."
        return "", [Turn((scene,), "Look at this picture.")], question, "yes" if truth else "no"
    first, second = rng.randint(1, 4), rng.randint(1, 4)
    scenes = (render_scene(_random_objects(rng, first)), render_scene(_random_objects(rng, second)))
    answer = "first" if first > second else "second" if second > first else "same"
    question = "Which picture has more objects? Answer first, second or same."
    return "", [Turn(scenes, "Here are two pictures.")], question, answer


def render_panel(badge: str, field_filled: bool, rng: random.Random) -> Image.Image:
    """A UI panel: a status badge (red alert / green ok) top right, a form field (dark when filled), three
    buttons, laid out with random offsets, title-bar colour and highlighted button (distractors)."""
    dx, dy = rng.randint(0, 6), rng.randint(0, 6)
    image = Image.new("RGB", (PANEL, PANEL), (250, 250, 250))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, PANEL, 14 + dy // 2], fill=tuple(rng.randint(40, 110) for _ in range(3)))
    badge_colour = COLOURS["red"] if badge == "alert" else COLOURS["green"]
    draw.ellipse([PANEL - 34 + dx, 22 + dy, PANEL - 10 + dx, 46 + dy], fill=badge_colour)
    field_fill = (40, 40, 40) if field_filled else (255, 255, 255)
    draw.rectangle([6 + dx, 56 + dy, PANEL - 14 + dx, 74 + dy], outline=(0, 0, 0), fill=field_fill)
    highlight = rng.randint(0, 2)
    for i in range(3):
        x0 = 6 + dx + i * 38
        outline = (230, 120, 0) if i == highlight else (90, 90, 90)
        draw.rectangle([x0, 90 + dy, x0 + 30, 112 + dy], fill=(120, 160, 220), outline=outline, width=3)
    return image


AGENTIC_FIELD = "account_role"  # the policy's mutable field (a ``{role}`` placeholder in AGENTIC_POLICY)
AGENTIC_POLICY = (
    "Policy. account_role: {role}. If the status badge is red: an admin answers click(approve), anyone else "
    "answers escalate(ticket). If the badge is green: answer click(submit) when the form field is filled, "
    "else fill(field)."
)


def agentic_answer(role: str, badge: str, field_filled: bool) -> str:
    """The tool call the policy prescribes."""
    if badge == "alert":
        return "click(approve)" if role == "admin" else "escalate(ticket)"
    return "click(submit)" if field_filled else "fill(field)"


AGENTIC_QUESTION = "What is the next action? Answer with one tool call."


def describe_screen(badge: str, field_filled: bool, ticket: int) -> str:
    """The text-only gate: the screen's state said in words instead of shown (the ticket number makes samples
    distinct, so both splits hold every combination)."""
    colour = "red" if badge == "alert" else "green"
    field = "a filled" if field_filled else "an empty"
    return f"Ticket {ticket}. The screen shows a {colour} status badge and {field} form field."


def _agentic(rng: random.Random, gate: str = "screen") -> tuple[str, list[Turn], str, str]:
    """A policy (``account_role`` field) and the screen's state, shown (``gate="screen"``) or said in words
    (``gate="text"``); 30% of samples then announce a new role in an erratum line (a system turn), which the
    answer must follow."""
    from mmkv.text.erratum import erratum_line

    role = rng.choice(["admin", "viewer"])
    badge = rng.choice(["alert", "ok"])
    filled = rng.random() < 0.5
    if gate == "screen":
        turns = [Turn((render_panel(badge, filled, rng),), "Here is the screen.")]
    else:
        turns = [Turn((), describe_screen(badge, filled, rng.randint(100, 999)))]
    system = AGENTIC_POLICY.format(role=role)
    if rng.random() < 0.3:
        role = rng.choice(["admin", "viewer"])  # the current value; may equal the old one
        turns.append(Turn((), erratum_line(AGENTIC_FIELD, role), role="system"))
    return system, turns, AGENTIC_QUESTION, agentic_answer(role, badge, filled)


def _trajectory(rng: random.Random) -> tuple[str, list[Turn], str, str]:
    num = rng.randint(2, 6)
    scenes_objects = []
    turns = []
    pool = []
    for i in range(num):
        if pool and rng.random() < 0.3:  # an earlier screen re-appears
            obj = rng.choice(pool)
        else:
            obj = _random_objects(rng, 1)[0]
            pool.append(obj)
        scenes_objects.append(obj)
        turns.append(Turn((render_scene([obj]),), f"Screen {i + 1}."))
    target = rng.randrange(num)
    kind = rng.choice(["colour", "shape"])
    obj = scenes_objects[target]
    question = f"What {kind} was the object on screen {target + 1}? Answer with one word."
    return "", turns, question, obj.colour if kind == "colour" else obj.shape


_GENERATORS = {
    "perception": _perception,
    "reasoning": _reasoning,
    "agentic": _agentic,
    "trajectory": _trajectory,
    "agentic_text": lambda rng: _agentic(rng, gate="text"),
}


def _content_digest(system: str, turns: list[Turn], question: str, answer: str) -> str:
    h = hashlib.sha256(b"mmkv-task-v2\0")
    h.update(f"{system}\0{question}\0{answer}\0".encode())
    for turn in turns:
        h.update(f"{turn.role}\0{turn.text}\0{len(turn.images)}\0".encode())
        for image in turn.images:
            h.update(image.tobytes())
    return h.hexdigest()


def _split_of(digest: str) -> str:
    return "heldout" if int(digest[:8], 16) % 5 == 0 else "train"  # about 20% held out


def iter_samples(category: str, seed: int, split: str) -> Iterator[Sample]:
    """An endless deterministic stream of ``category`` samples of ``split`` ("train" or "heldout")."""
    if category not in _GENERATORS:
        raise ValueError(f"unknown category {category!r}; choose from {TRAINING_CATEGORIES}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{category}/{seed}")
    for _ in range(200_000):  # far more draws than any split of any category needs
        system, turns, question, answer = _GENERATORS[category](rng)
        digest = _content_digest(system, turns, question, answer)
        if _split_of(digest) == split:
            yield Sample(category, system, tuple(turns), question, answer, digest)
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
