"""Decoding: the one loop that turns a prompt's last logits into an answer, for ``Session`` and the server alike.

A ``Decoder`` is an iterator of ``DecodeStep`` s. Per step it

1. asks ``should_stop()`` (cancellation, a deadline): the answer ends as ``"cancelled"``;
2. chooses a token from the logits, adjusted by the ``LogitRules`` (penalties, bias): greedy or sampled
   (``mmkv.runtime.sampling``), never a vision token, and within a grammar when a ``TokenConstraint`` is given
   (``mmkv.runtime.grammar``);
3. works out the token's text incrementally (``AnswerText``: each token is decoded with a bounded window of
   its predecessors, so an answer costs time linear in its length) and looks for stop strings in the new text
   only;
4. decides, once, whether the answer ends here (end of turn, the grammar complete, a stop string, the budget:
   ``finish_reason`` "stop" or "length");
5. otherwise appends the token to the live cache (``LiveCache.extend``) to get the next logits.

With ``logprobs`` set, each step also carries the model's log-probabilities (the log-softmax of its raw
logits, before any mask or temperature) of the chosen token and of the ``logprobs`` most likely ones.
Example::

    decoder = Decoder(handle, live, logits, DecodeOptions(32, stops=("\\n",)))
    for step in decoder:            # step.token, step.delta (text certain so far), step.logprob
        print(step.delta, end="")
    decoder.finish_reason, decoder.text, decoder.token_ids
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..model.handle import ModelHandle
from .answer_text import AnswerText, token_bytes
from .grammar import TokenConstraint
from .live import LiveCache
from .report import Answer, FinishReason, PrefillStats, TokenLogprob
from .sampling import GREEDY, LogitRules, Sampling, choose

__all__ = [
    "MAX_LOGPROBS",
    "DecodeOptions",
    "DecodeStep",
    "Decoder",
    "end_of_turn_id",
    "greedy_tokens",
    "vision_token_ids",
]

MAX_LOGPROBS = 20  # most alternatives a step reports (OpenAI's bound for top_logprobs)


@dataclass(frozen=True)
class DecodeOptions:
    """What one answer may be. Validated on construction."""

    max_new_tokens: int = 32  # budget (also bounded by the model's positions left)
    sampling: Sampling = GREEDY
    stops: tuple[str, ...] = ()  # the answer ends before the first of these strings
    logprobs: int | None = None  # None: none; k in [0, 20]: the chosen token's and the k most likely ones'
    rules: LogitRules = LogitRules()  # penalties and biases applied before choosing

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be an mmkv.runtime.Sampling, got {type(self.sampling).__name__}")
        if not isinstance(self.rules, LogitRules):
            raise TypeError(f"rules must be an mmkv.runtime.LogitRules, got {type(self.rules).__name__}")
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError("stops must be non-empty strings")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):  # fmt: skip
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


@dataclass(frozen=True)
class DecodeStep:
    """One chosen token."""

    token: int
    delta: str  # answer text now certain (never taken back; may be empty)
    logprob: TokenLogprob | None  # with DecodeOptions.logprobs


def vision_token_ids(handle: ModelHandle) -> list[int]:
    """Ids an answer must never contain: an image pad or vision marker would have no image behind it (the
    family's vision tokens the tokenizer has)."""
    vocab = handle.tokenizer.get_vocab()
    return [vocab[t] for t in handle.family.tokens.all if t in vocab]


def end_of_turn_id(handle: ModelHandle) -> int:
    """The id that ends an answer (the family's end of turn: ``<|im_end|>``, GLM's ``<|user|>``)."""
    return handle.processor.end_of_turn_id


class Decoder:
    """One answer being decoded over ``live``, from the prompt's ``logits`` (``(vocab,)``). Two ways to drive it:

    - iterate it (one sequence alone): each chosen token that does not end the answer is appended to ``live``
      (``LiveCache.extend``) for the next logits;
    - from an engine that decodes many sequences in one forward call (``mmkv.engine``): ``advance(logits)``
      chooses one token; while the answer is not ``finished``, the caller computes the KV of ``pending`` at
      ``pending_position`` (batched) and passes the logits that follow it to the next ``advance``.

    Afterwards ``finish_reason``, ``token_ids``, ``text`` and ``logprobs`` say what came out. Both ways choose
    the same tokens from the same logits (one code path, ``advance``)."""

    def __init__(
        self,
        handle: ModelHandle,
        live: LiveCache,
        logits: torch.Tensor,
        options: DecodeOptions = DecodeOptions(),
        *,
        constraint: TokenConstraint | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.handle, self.live, self.options = handle, live, options
        self.constraint, self.should_stop = constraint, should_stop
        self._logits = logits  # (vocab,) the prompt's last logits: the first advance's
        self.start_position = live.next_position  # the first answer token's position (text: (p, p, p))
        self.budget = max(1, min(options.max_new_tokens, handle.max_positions - self.start_position + 1))
        self.answer_text = AnswerText(handle.tokenizer, options.stops)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        self._banned = torch.tensor(vision_token_ids(handle), device=logits.device)  # (banned,)
        self._eos = end_of_turn_id(handle)
        self._generator = None
        sampling = options.sampling
        if sampling.temperature > 0 and sampling.seed is not None:
            self._generator = torch.Generator().manual_seed(sampling.seed)
        repeat = options.rules.repetition_penalty != 1.0
        self._prompt_ids = set(live.token_ids.tolist()) if repeat else set()

    @property
    def text(self) -> str:
        """The answer text (final once the answer is ``finished``)."""
        return self.answer_text.text

    @property
    def finished(self) -> bool:
        """Whether the answer has ended (``finish_reason`` says how)."""
        return self.finish_reason is not None

    @property
    def pending(self) -> int:
        """The last chosen token, whose KV the next logits need (only while not ``finished``)."""
        assert not self.finished and self.token_ids, "no token is pending"
        return self.token_ids[-1]

    @property
    def pending_position(self) -> int:
        """Where ``pending`` sits: every answer token is text, one position after the one before."""
        return self.start_position + len(self.token_ids) - 1

    def __iter__(self) -> Iterator[DecodeStep]:
        logits = self._logits
        while (step := self.advance(logits)) is not None:
            yield step
            if self.finished:
                return
            logits = self.live.extend(
                torch.tensor([self.pending]), torch.full((3, 1), self.pending_position, dtype=torch.long)
            )  # 5.

    @property
    def is_plain_greedy(self) -> bool:
        """Whether its choice is the argmax of the logits with the vision tokens banned (greedy, no logit rules,
        no grammar): an engine may then choose for many sequences in one call (``greedy_tokens``)."""
        options = self.options
        return options.sampling.temperature == 0 and options.rules.is_neutral and self.constraint is None

    def advance(self, logits: torch.Tensor | None = None, token: int | None = None) -> DecodeStep | None:
        """Steps 1-4 for one token from ``logits`` (``(vocab,)``: after ``pending``; None: the prompt's own, for
        the first token). ``token``: the choice already made from these logits by ``greedy_tokens`` (only when
        ``is_plain_greedy``). Returns the step, or None when ``should_stop`` ended the answer as "cancelled".
        Changes this decoder (and the constraint's state), never ``live``."""
        assert not self.finished, "the answer has ended"
        assert token is None or self.is_plain_greedy, "a precomputed choice needs plain greedy decoding"
        logits = self._logits if logits is None else logits
        options = self.options
        if self.should_stop is not None and self.should_stop():  # 1. cancellation, deadlines
            self.finish_reason = "cancelled"
            return None
        if token is None:  # 2. choose (else chosen already, with other sequences': greedy_tokens)
            scores = options.rules.apply(logits, self.token_ids, self._prompt_ids)
            masked = scores.index_fill(0, self._banned.to(logits.device), float("-inf"))
            if self.constraint is None:
                token = choose(masked, options.sampling, self._generator)
            else:  # among the grammar's allowed ids only: the same choice as masking the rest, without a full mask
                ids = self.constraint.allowed_ids().to(logits.device)  # (allowed,)
                token = int(ids[choose(masked[ids], options.sampling, self._generator)])
                self.constraint.advance(token)
        logprob = self._logprob(logits, token) if options.logprobs is not None else None
        if logprob is not None:
            self.logprobs.append(logprob)
        self.token_ids.append(token)
        delta = self.answer_text.add(token)  # 3. text
        ended = (  # 4. the one place an answer ends
            token == self._eos
            or self.answer_text.stopped
            or (self.constraint is not None and self.constraint.is_finished())
        )
        if ended or len(self.token_ids) == self.budget:
            self.finish_reason = "stop" if ended else "length"
            delta += self.answer_text.finish()
        return DecodeStep(token, delta, logprob)

    def answer(self, prefill: PrefillStats, ttft_s: float, total_s: float, queue_s: float = 0.0) -> Answer:
        """The turn's ``Answer``, once the iterator is exhausted (``prefill``: what the prompt took)."""
        assert self.finish_reason is not None, "the answer is not decoded yet"
        logprobs = tuple(self.logprobs) if self.options.logprobs is not None else None
        return Answer(
            self.text, tuple(self.token_ids), self.finish_reason, ttft_s, total_s, prefill, queue_s, logprobs
        )

    def _logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """The chosen token's log-probability and the ``options.logprobs`` most likely tokens' (raw logits)."""
        tokenizer = self.handle.tokenizer
        logp = torch.log_softmax(logits.double(), dim=-1)  # (vocab,)
        top = ()
        if self.options.logprobs:
            values, ids = logp.topk(self.options.logprobs)
            top = tuple(_entry(tokenizer, int(i), float(v)) for v, i in zip(values, ids, strict=True))
        chosen = _entry(tokenizer, token, float(logp[token]))
        return TokenLogprob(chosen.token_id, chosen.token, chosen.bytes, chosen.logprob, top)


def greedy_tokens(handle: ModelHandle, logits: torch.Tensor) -> list[int]:
    """The greedy choice of every row of ``(B, vocab)`` logits, vision tokens banned: one call and one transfer
    to the host for a whole batch (what ``Decoder.advance`` chooses row by row when ``is_plain_greedy``)."""
    banned = torch.tensor(vision_token_ids(handle), device=logits.device)  # (banned,)
    return logits.index_fill(1, banned, float("-inf")).argmax(-1).tolist()


def _entry(tokenizer, token_id: int, logprob: float) -> TokenLogprob:
    raw = token_bytes(tokenizer, token_id)
    return TokenLogprob(token_id, raw.decode("utf-8", errors="replace"), tuple(raw), logprob)
