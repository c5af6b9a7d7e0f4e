"""The suite's records: a ``Turn`` of a conversation and a ``Sample`` (a conversation, a question, its answer)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

__all__ = ["Generated", "Sample", "Turn"]


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

    category: str  # one of TRAINING_CATEGORIES, or "custom"
    system: str  # system text ("" for none)
    turns: tuple[Turn, ...]  # earlier turns (context)
    question: str  # the final question
    answer: str  # the expected short answer
    digest: str  # content hash (pixels, texts, answer): the sample's identity
    also: tuple[tuple[str, str], ...] = ()  # other (question, answer) pairs the same turns answer: training's
    # dense supervision (``training/data.py``); no eval scores them, and they are not part of the digest

    @property
    def num_images(self) -> int:
        """Images across all turns."""
        return sum(len(t.images) for t in self.turns)

    @property
    def images(self) -> list[Image.Image]:
        """Every image, in conversation order."""
        return [image for turn in self.turns for image in turn.images]


# what a category generator returns: system, turns, question, answer, and the other (question, answer) pairs the
# same turns answer (``Sample.also``; derived from what was drawn, never drawing from the generator's rng, so the
# stream of samples is the same with or without them)
Generated = tuple[str, list[Turn], str, str, tuple[tuple[str, str], ...]]
