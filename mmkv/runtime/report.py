"""What a turn reports: ``PrefillStats`` (bringing the live cache up to a prompt) and ``Answer`` (one ``ask``).

Both are plain records; ``ImageReuse`` (where each image came from) is made by the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .plan import ImageReuse

__all__ = ["Answer", "PrefillStats"]


@dataclass(frozen=True)
class Answer:
    """The result of one ``ask``."""

    text: str  # the decoded answer, special tokens removed
    token_ids: tuple[int, ...]  # generated ids (the end-of-turn token included when produced)
    ttft_s: float  # seconds from the call to the first answer token
    total_s: float  # seconds for the whole call
    prompt_tokens: int  # tokens in the rendered prompt
    prefilled_tokens: int  # prompt tokens run through the language model this turn
    reused_tokens: int  # prompt tokens whose KV came from the live cache or a store
    images: tuple[ImageReuse, ...]  # one entry per image in the prompt


@dataclass
class PrefillStats:
    """What bringing the live cache up to one prompt took."""

    prompt_tokens: int = 0  # tokens in the prompt
    prefilled: int = 0  # tokens run through the language model
    reused: int = 0  # tokens whose KV came from the live cache or a store
    images: list[ImageReuse] = field(default_factory=list)  # where each image of the prompt came from
    seconds: float = 0.0  # from rendering to the first token's logits on the host; store writes excluded
    forward_seconds: float = 0.0  # of which in the model's forward (the rest is mmkv's own host work)
