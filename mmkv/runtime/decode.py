"""Decoding an answer over a live cache: greedy (temperature 0) or sampled (temperature, top-p, seed), one token
at a time, never a vision token.

``generate`` is a generator: it yields each answer token as soon as it is chosen, so a caller can stream the
text and stop early. Every yielded token that does not end the answer is prefilled into the live cache (at the
position after the last one) before the next is chosen; the ending token (end of turn, or the last allowed)
is not. Example::

    tokens = list(generate(handle, live, logits, max_new_tokens=32))          # greedy
    for token in generate(handle, live, logits, 32, Sampling(0.7, 0.9, seed=1)):
        ...                                                                    # sampled, reproducible
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..kv.prefill import prefill_span
from ..model.handle import ModelHandle
from .live import LiveCache

__all__ = ["GREEDY", "AnswerText", "Sampling", "end_of_turn_id", "generate", "vision_token_ids"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. Validated on construction."""

    temperature: float = 0.0  # 0: greedy (argmax); > 0: softmax(logits / temperature) sampled
    top_p: float = 1.0  # nucleus: sample among the most likely tokens whose probabilities sum to top_p
    seed: int | None = None  # a seed makes sampling reproducible

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not 0.0 < self.top_p <= 1.0
        ):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


GREEDY = Sampling()


def vision_token_ids(handle: ModelHandle) -> list[int]:
    """Ids an answer must never contain: an image pad or vision marker would have no image behind it."""
    proc = handle.processor
    ids = [proc.image_token_id, proc.vision_start_token_id, proc.vision_end_token_id]
    video = handle.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    if isinstance(video, int) and video >= 0:
        ids.append(video)
    return ids


def end_of_turn_id(handle: ModelHandle) -> int:
    """The id that ends an answer (``<|im_end|>``)."""
    return int(handle.tokenizer.convert_tokens_to_ids("<|im_end|>"))


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from ``(vocab,)`` logits with the banned ids already at -inf."""
    if sampling.temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)  # (vocab,)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = (
            sorted_probs.cumsum(0) - sorted_probs >= sampling.top_p
        )  # mass before each already covers top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate(
    handle: ModelHandle,
    live: LiveCache,
    logits: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` answer tokens, starting from ``logits`` (``(vocab,)``, after the prompt
    that ``live`` holds). Mutates ``live``: each yielded token that does not end the answer is appended."""
    banned = torch.tensor(vision_token_ids(handle))
    eos = end_of_turn_id(handle)
    generator = None
    if sampling.temperature > 0 and sampling.seed is not None:
        generator = torch.Generator().manual_seed(sampling.seed)
    position = live.next_position
    for count in range(1, max_new_tokens + 1):
        token = _choose(logits.index_fill(0, banned.to(logits.device), float("-inf")), sampling, generator)
        yield token
        if token == eos or count == max_new_tokens:
            return
        ids = torch.tensor([token])
        pos = torch.full((3, 1), position, dtype=torch.long)
        logits = prefill_span(handle, ids, pos, context=live.cache, keep_segment=False).logits
        live.append_tokens(ids, pos)
        position += 1


class AnswerText:
    """The answer's text as tokens arrive: the same text ``Session.ask`` gives (decoded, special tokens removed,
    stripped, cut at the first stop string), streamed as deltas that never need taking back."""

    def __init__(self, tokenizer, stops: list[str] = (), emit=None) -> None:
        """``emit(delta)`` receives each new piece of text (None: nothing is emitted)."""
        self.tokenizer, self.stops, self.emit = tokenizer, list(stops), emit or (lambda delta: None)
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that may still become a stop string
        self.sent = 0
        self.text = ""

    def add(self, tokens: list[int]) -> bool:
        """Take the tokens so far; emit what is certain; True when a stop string appeared."""
        decoded = self.tokenizer.decode(tokens, skip_special_tokens=True).lstrip()
        for stop in self.stops:
            at = decoded.find(stop)
            if at >= 0:
                self.text = decoded[:at]
                return True
        self.text = decoded
        if decoded.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            return False
        certain = len(decoded.rstrip()) - self.hold
        if certain > self.sent:
            self.emit(decoded[self.sent : certain])
            self.sent = certain
        return False

    def finish(self) -> str:
        """The final text (emitting what is left of it)."""
        final = self.text.strip()
        if len(final) > self.sent:
            self.emit(final[self.sent :])
        self.sent = len(final)
        return final
