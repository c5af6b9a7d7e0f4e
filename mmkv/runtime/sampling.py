"""How the next token is chosen: ``Sampling`` (greedy, or temperature / top-p / top-k with a seed) and
``LogitRules`` (OpenAI's presence and frequency penalties and logit bias, vLLM's repetition penalty), applied to
one step's logits. Numerically safe for every valid setting: no inf/nan at tiny temperatures, never an empty
nucleus at a tiny ``top_p``. Example::

    rules = LogitRules(presence_penalty=0.5, logit_bias=((42, -100.0),))
    scores = rules.apply(logits, generated=[7, 7, 9], prompt_ids=set())    # (vocab,) adjusted copy
    token = choose(scores, Sampling(0.7, 0.9, seed=1), generator)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

__all__ = ["GREEDY", "SEED_RANGE", "LogitRules", "Sampling", "choose"]

SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. Validated on construction."""

    temperature: float = 0.0  # 0: greedy (argmax); > 0: softmax(logits / temperature) sampled
    top_p: float = 1.0  # nucleus: sample among the most likely tokens whose probabilities sum to top_p
    seed: int | None = None  # a seed makes sampling reproducible
    top_k: int = 0  # sample among the k most likely tokens only (0: no bound)

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
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be an int in [-2**63, 2**64), got {self.seed!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")


GREEDY = Sampling()


@dataclass(frozen=True)
class LogitRules:
    """Adjustments of one step's logits before a token is chosen (never of the logprobs reported, which are the
    model's own). Validated on construction; all neutral by default."""

    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token generated so far, [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the answer so far, [-2, 2]
    repetition_penalty: float = 1.0  # vLLM: tokens of the prompt or answer scaled by 1/p (positive) or p, > 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI: (token id, bias in [-100, 100]) added

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0.0 < penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be a number in (0, 100], got {penalty!r}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")

    @property
    def is_neutral(self) -> bool:
        """Whether applying them changes nothing."""
        return (
            self.presence_penalty == 0 and self.frequency_penalty == 0 and self.repetition_penalty == 1.0
            and not self.logit_bias
        )  # fmt: skip

    def apply(
        self, logits: torch.Tensor, generated: Sequence[int], prompt_ids: Collection[int]
    ) -> torch.Tensor:
        """``logits`` (``(vocab,)``) adjusted for an answer that so far holds ``generated`` after a prompt holding
        ``prompt_ids``; a new tensor (the input is not changed). Token ids past the vocabulary are ignored."""
        if self.is_neutral:
            return logits
        scores, vocab = logits.clone(), int(logits.shape[0])
        if self.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in (*prompt_ids, *generated) if t < vocab}), dtype=torch.long)
            if seen.numel():
                chosen = scores[seen]
                scores[seen] = torch.where(
                    chosen > 0, chosen / self.repetition_penalty, chosen * self.repetition_penalty
                )
        if generated and (self.presence_penalty or self.frequency_penalty):
            counts = Counter(t for t in generated if t < vocab)
            ids = torch.tensor(list(counts), dtype=torch.long)
            times = torch.tensor(list(counts.values()), dtype=scores.dtype)
            scores[ids] -= self.presence_penalty + self.frequency_penalty * times
        for token, bias in self.logit_bias:
            if token < vocab:
                scores[token] += bias
        return scores


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from ``(vocab,)`` logits whose banned entries are -inf. Numerically safe for any valid
    ``Sampling``: the maximum is subtracted before scaling (no inf / nan at tiny temperatures) and nucleus
    filtering always keeps the most likely token (no empty distribution at tiny ``top_p``); ``top_k`` keeps the
    k most likely. Changes nothing."""
    if sampling.temperature == 0.0:
        return int(logits.argmax())
    if sampling.top_k and sampling.top_k < int(logits.shape[0]):
        kth = logits.topk(sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # (vocab,) the k most likely (ties kept)
    scaled = (logits.double() - logits.max().double()) / sampling.temperature  # (vocab,) <= 0, max at 0
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= sampling.top_p  # mass before each covers top_p
        outside[0] = False
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
