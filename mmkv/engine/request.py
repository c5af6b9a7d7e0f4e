"""``Request``: the record the engine keeps per request, passed between its scheduler, runner and driver.

It holds what the request asks (its prompt's layout, images, policy, decode options and grammar, its deadline),
the facts computed once about it (its KV bytes, the pool's matching prefix), and its state as it moves through
the engine::

    WAITING --admit--> PREFILLING --prompt done--> RUNNING --answer ends--> FINISHED
       \\______________________\\__________________________\\--cancelled, past its deadline, failed--> FINISHED

Events go back through ``emit`` (any thread's callable: the server's hands them to its event loop, a
``Session`` collects them). Only the engine changes a request's state; ``cancel`` may be called from any thread
and takes effect at the engine's next step.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..messages import ConversationImage
from ..prompt.layout import PromptLayout
from ..runtime import DecodeOptions, Decoder, LiveCache, TokenConstraint, TurnPolicy
from ..runtime.report import PrefillStats
from .events import Event

__all__ = ["Request", "Status"]


class Status(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"  # queued: no model work yet
    PREFILLING = "prefilling"  # its prompt is being brought into a live cache (in chunks)
    RUNNING = "running"  # decoding, a row of the decode batch
    FINISHED = "finished"  # answered, cancelled or failed: the engine holds nothing of it


@dataclass(eq=False)
class Request:
    """One request's work and state. Built by the caller (``layout`` already made, off the model thread);
    validated on construction."""

    layout: PromptLayout  # the prompt: ids, positions, pieces (image i of it is images[i])
    images: Sequence[ConversationImage]  # the conversation's images
    policy: TurnPolicy  # reuse, seam, repair, budget
    options: DecodeOptions  # budget, sampling, stops, logprobs, logit rules
    emit: Callable[[Event], None]  # where its events go (thread-safe as the caller needs)
    constraint: TokenConstraint | None = None  # a grammar the answer must follow (tools, response_format)
    deadline: float | None = None  # time.monotonic() past which it is abandoned (None: never)
    live: LiveCache | None = None  # a live cache to continue (a Session's); None: the engine's pool chooses
    submitted: float = field(default_factory=time.monotonic)
    # state (the engine's)
    status: Status = Status.WAITING
    keep: int | None = None  # entries of ``live`` matching the prompt, as the pool computed them once
    decoder: Decoder | None = None  # while running: the answer so far
    stats: PrefillStats | None = None  # what the prompt took, once prefilled
    queue_s: float = 0.0  # seconds waited before admission
    started: float = 0.0  # perf_counter() at admission
    ttft_s: float = 0.0
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, PromptLayout):
            raise TypeError(f"layout must be a PromptLayout, got {type(self.layout).__name__}")
        if self.layout.num_tokens == 0:
            raise ValueError("the prompt is empty")
        if not isinstance(self.options, DecodeOptions):
            raise TypeError(f"options must be DecodeOptions, got {type(self.options).__name__}")
        if not callable(self.emit):
            raise TypeError("emit must be callable")

    def cancel(self) -> None:
        """Ask the engine to drop the request (its client went away); thread-safe, takes effect at the next
        step. Nothing more is emitted after a cancellation takes effect."""
        self._cancelled.set()

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def is_expired(self) -> bool:
        """Whether its deadline has passed."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def should_stop(self) -> bool:
        """Whether decoding must stop now: cancelled or past its deadline (the decoder asks every token)."""
        return self.is_cancelled or self.is_expired

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def kv_tokens(self) -> int:
        """Entries its live cache may reach: the prompt and the whole answer budget."""
        return self.layout.num_tokens + self.options.max_new_tokens
