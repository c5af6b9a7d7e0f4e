"""What a turn reports: ``PrefillStats`` (bringing the live cache up to a prompt) and ``Answer`` (one answered
turn: ``Session.ask`` / ``stream`` and the server's requests alike).

Both are frozen records; ``ImageReuse`` (where each image came from) is made by the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..messages import ToolCall
from .plan import ImageReuse

__all__ = ["Answer", "FinishReason", "PrefillStats", "RepairStats", "TokenLogprob"]

FinishReason = Literal["stop", "length", "cancelled"]  # why an answer ended


@dataclass(frozen=True)
class TokenLogprob:
    """The model's log-probability of one token at one step (OpenAI's ``logprobs.content`` entry)."""

    token_id: int
    token: str  # its text (a token that is part of a multi-byte character shows U+FFFD)
    bytes: tuple[int, ...]  # its exact UTF-8 bytes
    logprob: float  # log-softmax of the raw logits
    # the most likely tokens at this step, descending (their own ``top`` empty)
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RepairStats:
    """What a turn recomputed of the KV it spliced (``TurnPolicy.repair`` and ``budget``), and what choosing cost.
    All counts are prompt tokens of this turn; zero when nothing was spliced."""

    kind: str = "seam"  # the repair in force: "seam", "deviation", "attention"
    budget: float = 0.0  # the budget in force (fraction of each segment's spliced tokens after its seam)
    placed: int = (
        0  # tokens of cached segments placed at new positions (store-hit images, precompiled and cut-off
    )
    # text), their seams included
    recomputed: int = 0  # of which computed in context: the seams and the repair's choice
    chosen: int = 0  # of which chosen by the repair (beyond the seams)
    image_tokens: int = 0  # placed tokens of spliced images (their markers included)
    image_recomputed: int = 0  # of which computed in context
    pass_tokens: int = (
        0  # tokens the ranking ran through the model: deviation over the first layers, attention as
    )
    # queries over every layer (0 for "seam", which needs no pass)
    pass_layers: int = 0  # language-model layers of that pass
    seconds: float = (
        0.0  # wall time of choosing (vision outputs, the pass, the ranking); within the turn's time
    )

    @property
    def fraction(self) -> float:
        """Share of the placed tokens recomputed in context (0 when none were placed)."""
        return self.recomputed / self.placed if self.placed else 0.0

    @property
    def image_fraction(self) -> float:
        """Share of the spliced images' tokens recomputed in context (0 when none were spliced)."""
        return self.image_recomputed / self.image_tokens if self.image_tokens else 0.0


@dataclass(frozen=True)
class PrefillStats:
    """What bringing the live cache up to one prompt took."""

    prompt_tokens: int = 0  # tokens in the prompt
    prefilled: int = 0  # tokens run through the language model
    reused: int = 0  # tokens whose KV came from the live cache or a store
    images: tuple[ImageReuse, ...] = ()  # where each image of the prompt came from
    seconds: float = 0.0  # from rendering to the first token's logits on the host; store writes excluded
    forward_seconds: float = 0.0  # of which in the model's forward (the rest is mmkv's own host work)
    repair: RepairStats = field(
        default_factory=RepairStats
    )  # what was recomputed of the spliced KV, and the ranking's cost


@dataclass(frozen=True)
class Answer:
    """One answered turn."""

    text: str  # the decoded answer, special tokens removed, stripped, cut at a stop string
    token_ids: tuple[int, ...]  # generated ids (the end-of-turn token included when produced)
    finish_reason: FinishReason  # "stop" (end of turn, grammar complete, stop string), "length", "cancelled"
    ttft_s: float  # seconds from the call (the server: from the worker taking the job) to the first token
    total_s: float  # seconds for the whole call
    prefill: PrefillStats  # what bringing the cache up to the prompt took
    queue_s: float = 0.0  # seconds waiting for the model (the server's queue; 0 in a Session)
    logprobs: tuple[TokenLogprob, ...] | None = None  # per generated token, when asked for
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer makes (a Session with tools declared)

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the rendered prompt."""
        return self.prefill.prompt_tokens

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens run through the language model this turn."""
        return self.prefill.prefilled

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV came from the live cache or a store."""
        return self.prefill.reused

    @property
    def images(self) -> tuple[ImageReuse, ...]:
        """One entry per image in the prompt: where its KV came from."""
        return self.prefill.images
