"""Decoding: the one loop that turns a prompt's last logits into an answer, for ``Session`` and the server alike.

A ``Decoder`` is an iterator of ``DecodeStep`` s. Per step it

1. asks ``should_stop()`` (cancellation, a deadline): the answer ends as ``"cancelled"``;
2. chooses a token from the logits: greedy or sampled (``Sampling``), never a vision token, and within a
   grammar when a ``TokenConstraint`` is given (``mmkv.runtime.grammar``);
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

import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..model.handle import ModelHandle
from .grammar import TokenConstraint
from .live import LiveCache
from .report import Answer, FinishReason, PrefillStats, TokenLogprob

__all__ = [
    "GREEDY",
    "MAX_LOGPROBS",
    "AnswerText",
    "DecodeOptions",
    "DecodeStep",
    "Decoder",
    "FinishReason",
    "Sampling",
    "TokenConstraint",
    "TokenLogprob",
    "end_of_turn_id",
    "token_bytes",
    "vision_token_ids",
]

MAX_LOGPROBS = 20  # most alternatives a step reports (OpenAI's bound for top_logprobs)
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes


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
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be an int in [-2**63, 2**64), got {self.seed!r}")


GREEDY = Sampling()


@dataclass(frozen=True)
class DecodeOptions:
    """What one answer may be. Validated on construction."""

    max_new_tokens: int = 32  # budget (also bounded by the model's positions left)
    sampling: Sampling = GREEDY
    stops: tuple[str, ...] = ()  # the answer ends before the first of these strings
    logprobs: int | None = None  # None: none; k in [0, 20]: the chosen token's and the k most likely ones'

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be an mmkv.runtime.Sampling, got {type(self.sampling).__name__}")
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


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``) inverted: character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {id: bytes}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The exact bytes token ``token_id`` stands for (byte-level BPE pieces mapped back to bytes; added tokens
    as their text). Cached beside the tokenizer, not on it."""
    cache = _TOKEN_BYTES.setdefault(tokenizer, {})
    found = cache.get(token_id)
    if found is None:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if piece is None:
            found = b""
        elif token_id in getattr(tokenizer, "added_tokens_decoder", {}) or not all(
            c in decoder for c in piece
        ):
            found = (
                tokenizer.decode([token_id]) if token_id not in tokenizer.all_special_ids else piece
            ).encode()
        else:
            found = bytes(decoder[c] for c in piece)
        cache[token_id] = found
    return found


class AnswerText:
    """The answer's text as tokens arrive: the text ``Session.ask`` gives (decoded, special tokens removed,
    stripped, cut at the first stop string), streamed as deltas that never need taking back, in time linear in
    the answer: each token is decoded together with the few before it that are not yet certain text (a
    multi-byte character split over tokens waits for its last byte), and stop strings are looked for only in
    the text that is new (``decoded_tokens`` counts the tokens passed to the tokenizer, for tests)."""

    def __init__(self, tokenizer, stops: tuple[str, ...] | list[str] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # chars that may still become a stop
        self.tokens: list[int] = []
        self._prefix, self._read = 0, 0  # token window: [prefix, read) decoded already, [read, ...) pending
        self.raw = ""  # decoded text so far (certain characters only)
        self._lead = -1  # index in raw of the first non-space character (-1: none yet)
        self._searched = 0  # raw[:_searched] holds no stop string start that could complete
        self._cut: int | None = None  # where a stop string starts, once one appeared
        self.sent = 0  # chars of the answer (raw[lead:]) emitted
        self.decoded_tokens = 0

    @property
    def stopped(self) -> bool:
        """Whether a stop string appeared."""
        return self._cut is not None

    def add(self, token: int) -> str:
        """Take the next token; return the answer text that became certain (empty while it may still change)."""
        if self._cut is not None:
            return ""
        self.tokens.append(token)
        window = self.tokens[self._prefix :]
        known = self._decode(self.tokens[self._prefix : self._read])
        text = self._decode(window)
        if len(text) > len(known) and not text.endswith("\ufffd"):
            self._grow(text[len(known) :])
            self._prefix, self._read = self._read, len(self.tokens)
        return self._emit(final=False)

    def finish(self) -> str:
        """End the answer: the last text not emitted yet (``text`` is then final)."""
        if self._cut is None and self._read < len(self.tokens):  # a trailing partial character
            known = self._decode(self.tokens[self._prefix : self._read])
            self._grow(self._decode(self.tokens[self._prefix :])[len(known) :])
            self._read = len(self.tokens)
        return self._emit(final=True)

    @property
    def text(self) -> str:
        """The answer so far as ``finish`` would give it (stripped, cut at a stop string)."""
        if self._lead < 0:
            return ""
        end = len(self.raw) if self._cut is None else self._cut
        return self.raw[self._lead : end].strip()

    def _decode(self, tokens: list[int]) -> str:
        self.decoded_tokens += len(tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""

    def _grow(self, delta: str) -> None:
        """Append certain characters; find the first non-space and any stop string in the new text."""
        self.raw += delta
        if self._lead < 0:
            stripped = len(self.raw) - len(self.raw.lstrip())
            if stripped == len(self.raw):
                return
            self._lead = self._searched = stripped
        if self.stops:
            window = self.raw[self._searched :]
            hits = [at for at in (window.find(s) for s in self.stops) if at >= 0]
            if hits:
                self._cut = self._searched + min(hits)
            else:
                self._searched = max(self._searched, len(self.raw) - self.hold)

    def _emit(self, final: bool) -> str:
        """Answer text now certain and not emitted yet."""
        if self._lead < 0:
            return ""
        end = len(self.raw) if self._cut is None else self._cut
        if final or self._cut is not None:
            certain = len(self.raw[self._lead : end].rstrip())
        else:
            tail = len(self.raw) - len(self.raw.rstrip())  # trailing spaces may be stripped at the end
            certain = end - self._lead - tail - self.hold
        if certain <= self.sent:
            return ""
        delta = self.raw[self._lead + self.sent : self._lead + certain]
        self.sent = certain
        return delta


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from ``(vocab,)`` logits whose banned entries are -inf. Numerically safe for any valid
    ``Sampling``: the maximum is subtracted before scaling (no inf / nan at tiny temperatures) and nucleus
    filtering always keeps the most likely token (no empty distribution at tiny ``top_p``)."""
    if sampling.temperature == 0.0:
        return int(logits.argmax())
    scaled = (logits.double() - logits.max().double()) / sampling.temperature  # (vocab,) <= 0, max at 0
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= sampling.top_p  # mass before each covers top_p
        outside[0] = False
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class Decoder:
    """One answer being decoded over ``live``, from the prompt's ``logits`` (``(vocab,)``). Iterate it for the
    ``DecodeStep`` s; afterwards ``finish_reason``, ``token_ids``, ``text`` and ``logprobs`` say what came out.
    Mutates ``live``: every chosen token that does not end the answer is appended (``LiveCache.extend``)."""

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
        self._logits = logits
        self.budget = max(1, min(options.max_new_tokens, handle.max_positions - live.next_position + 1))
        self.answer_text = AnswerText(handle.tokenizer, options.stops)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None

    @property
    def text(self) -> str:
        """The answer text (final once the iterator is exhausted)."""
        return self.answer_text.text

    def __iter__(self) -> Iterator[DecodeStep]:
        handle, options = self.handle, self.options
        banned = torch.tensor(vision_token_ids(handle))
        eos = end_of_turn_id(handle)
        sampling = options.sampling
        generator = None
        if sampling.temperature > 0 and sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)
        position = self.live.next_position
        logits = self._logits
        for count in range(1, self.budget + 1):
            if self.should_stop is not None and self.should_stop():  # 1. cancellation, deadlines
                self.finish_reason = "cancelled"
                return
            masked = logits.index_fill(0, banned.to(logits.device), float("-inf"))  # 2. choose
            if self.constraint is not None:
                allowed = self.constraint.allowed().to(logits.device)
                masked = masked.masked_fill(~allowed[: masked.shape[0]], float("-inf"))
            token = _choose(masked, sampling, generator)
            if self.constraint is not None:
                self.constraint.advance(token)
            logprob = self._logprob(logits, token) if options.logprobs is not None else None
            if logprob is not None:
                self.logprobs.append(logprob)
            self.token_ids.append(token)
            delta = self.answer_text.add(token)  # 3. text
            ended = (  # 4. the one place an answer ends
                token == eos
                or self.answer_text.stopped
                or (self.constraint is not None and self.constraint.is_finished())
            )
            if ended or count == self.budget:
                self.finish_reason = "stop" if ended else "length"
                delta += self.answer_text.finish()
                yield DecodeStep(token, delta, logprob)
                return
            yield DecodeStep(token, delta, logprob)
            logits = self.live.extend(
                torch.tensor([token]), torch.full((3, 1), position, dtype=torch.long)
            )  # 5.
            position += 1

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


def _entry(tokenizer, token_id: int, logprob: float) -> TokenLogprob:
    raw = token_bytes(tokenizer, token_id)
    return TokenLogprob(token_id, raw.decode("utf-8", errors="replace"), tuple(raw), logprob)
