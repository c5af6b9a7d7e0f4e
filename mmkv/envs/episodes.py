"""Whole episodes of the desktop played right (``expert_episode``): what training, evals and examples replay.

An ``Episode`` keeps the system policy, the task, the first screenshot and each right step (call, tool result,
next screenshot, the decision's kind). ``Episode.messages(k)`` is the message list an agent sends before its
``k``-th call (``agent_messages``), and ``steps[k].call`` the call that is right there. Held-out episodes use
``split="heldout"``: other seeds' streams and pictures never shown in a training episode (the app's split rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from ..synthetic import Split
from ..toolcalls import FunctionCall
from .desktop import DesktopApp
from .messages import ScreenshotIn, agent_messages
from .tools import tool_specs

__all__ = ["Episode", "EpisodeStep", "expert_episode"]


@dataclass(frozen=True, slots=True)
class EpisodeStep:
    """One right step."""

    call: FunctionCall  # the right call
    result: str  # the tool's text result
    image: Image.Image  # the screenshot after it
    kind: str  # approve, escalate, fill, submit, ok or close
    uses_history: bool  # the call depended on an earlier step (a returning ticket, a new role)


@dataclass(frozen=True)
class Episode:
    """An episode played right from ``DesktopApp(split).reset(seed)``."""

    seed: int  # the app's seed
    split: Split  # "train" or "heldout"
    system: str  # the policy (system message)
    task: str  # the first user message's text
    first_image: Image.Image  # the first screenshot
    steps: tuple[EpisodeStep, ...]  # 4-10 right steps

    @property
    def tools(self) -> list[dict]:
        """The app's tool specs (a fresh copy)."""
        return tool_specs()

    def messages(
        self, upto: int, *, screenshot_in: ScreenshotIn = "tool", window: int | None = 3, as_url: bool = True
    ) -> list[dict]:
        """The messages an agent sends before call ``upto`` (0-based; ``len(steps)``: after the last)."""
        if not 0 <= upto <= len(self.steps):
            raise ValueError(f"upto must be in [0, {len(self.steps)}], got {upto}")
        return agent_messages(
            self.system, self.task, self.first_image, self.steps[:upto],
            screenshot_in=screenshot_in, window=window, as_url=as_url,
        )  # fmt: skip


def expert_episode(seed: int, split: Split = "train") -> Episode:
    """The episode of ``(seed, split)`` with every call right."""
    app = DesktopApp(split)
    first = app.reset(seed)
    steps = []
    while not app.done:
        call = app.expected_call()
        assert call is not None
        result = app.step(call.name, call.arguments)
        assert result.is_right, (seed, call)
        steps.append(EpisodeStep(call, result.text, result.image, result.kind, result.uses_history))
    return Episode(seed, split, app.policy, first.text, first.image, tuple(steps))
