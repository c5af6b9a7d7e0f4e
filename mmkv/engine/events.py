"""What a request hears from the engine, in order: ``Started`` (admitted), ``First`` (the prompt prefilled),
one ``Delta`` per decoded token, then ``Done`` (the ``Answer``) or ``Failed`` (the exception). Typed messages
between the engine's thread and whoever waits for the request (the server's event loop, a ``Session``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import Answer, DecodeStep
from ..runtime.report import PrefillStats

__all__ = ["Delta", "Done", "Event", "Failed", "First", "Started"]


@dataclass(frozen=True)
class Started:
    """The engine admitted the request (its prefill begins)."""

    queue_s: float  # seconds it waited


@dataclass(frozen=True)
class First:
    """The prompt is prefilled: the first token's logits are known."""

    stats: PrefillStats
    ttft_s: float


@dataclass(frozen=True)
class Delta:
    """One decoded token."""

    step: DecodeStep


@dataclass(frozen=True)
class Done:
    """The answer is complete."""

    answer: Answer


@dataclass(frozen=True)
class Failed:
    """The request failed; ``error`` says why (the HTTP layer chooses the status by its type)."""

    error: BaseException


Event = Started | First | Delta | Done | Failed
