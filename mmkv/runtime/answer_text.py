"""An answer's text as its tokens arrive: ``AnswerText`` (incremental detokenisation, stop strings, the deltas a
stream sends) and ``token_bytes`` (the exact bytes of one token, for logprobs).

Knows nothing about models: a tokenizer and token ids in, text out. Example::

    text = AnswerText(tokenizer, stops=("\n\n",))
    for token in tokens:
        send(text.add(token))       # "" while the text may still change (a split character, a stop string)
        if text.stopped:
            break
    send(text.finish())             # the rest; text.text is the final answer
"""

from __future__ import annotations

import functools
import weakref

__all__ = ["AnswerText", "token_bytes"]


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
