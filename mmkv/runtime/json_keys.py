"""``KeyGuard``: unique keys in the JSON objects of a constrained answer.

llguidance writes declared properties once each, but a free map (``json_object``, ``additionalProperties``) may
repeat a key, ``{"note": 1, "note": 1}``: JSON that a strict parser (unique keys) refuses and that ``json.loads``
silently reads as its last value. A grammar cannot say "a key not written before" (the language is not
context-free), so the guard follows the answer's bytes instead, knows the keys of every open object, and names
the tokens whose bytes would close a key its object already holds; the constraint removes them from its mask. A
token may hold a whole key, quotes and all (``""``, or ``, "note": `` in a tokenizer whose merges cross
punctuation), or close an object and write a key of the one around it (``}, "a"``): each candidate token is
followed from the current state, byte by byte, on a copy of it. The key is compared decoded (``"a"`` and
``"\\u0061"`` are the same). Knows nothing about grammars beyond the bytes of tokens; text outside JSON (tool-call
tags) holds no quotes.

    guard = KeyGuard({7: b'"', 8: b'a"', 9: b', "a"'})   # token id -> bytes, for the tokens holding a quote
    guard.feed(b'{"a": 1')                               # an object holding "a", after its value
    guard.repeating(mask)                                # array([9]): ', "a"' would write "a" again
    guard.feed(b', "')                                   # inside a new key
    guard.repeating(mask)                                # array([8]): 'a"' would; '"' (the key "") is fine
"""

from __future__ import annotations

import json

import numpy as np

__all__ = ["KeyGuard"]

_QUOTE, _BACKSLASH = 0x22, 0x5C


class KeyGuard:
    """The JSON structure of an answer so far, for unique keys. ``feed`` changes state; ``repeating`` does not."""

    def __init__(self, quote_tokens: dict[int, bytes]) -> None:
        self._quote_ids = np.fromiter(quote_tokens, dtype=np.intp, count=len(quote_tokens))  # (num_quote,)
        # (num_quote,) how many quotes each of those tokens holds: a token with too few cannot close a repeat
        self._num_quotes = np.fromiter(
            (data.count(b'"') for data in quote_tokens.values()), dtype=np.intp, count=len(quote_tokens)
        )
        self._quote_bytes = quote_tokens  # id -> the token's bytes
        # the open containers, innermost last: an object's keys so far (frozen: a copy of the guard shares them
        # until it adds a key), or None for an array
        self._objects: list[frozenset[str] | None] = []
        self._expect_key = False  # the innermost object's next string is a key
        self._in_string = False  # inside a string
        self._in_key = False  # ... and it is a key of the innermost object
        self._escaped = False  # the last byte of the string so far is an unfinished backslash escape
        self._key = bytearray()  # the raw bytes of the key being written (escapes as written)

    def feed(self, data: bytes) -> bool:
        """Follow the bytes of one more token of the answer. Returns whether they closed a key its object
        already held (never, for tokens ``repeating`` did not name)."""
        repeated = False
        for byte in data:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif byte == _BACKSLASH:
                    self._escaped = True
                elif byte == _QUOTE:
                    keys = self._objects[-1] if self._in_key and self._objects else None
                    if keys is not None:
                        key = _decoded(bytes(self._key))
                        repeated = repeated or key in keys
                        self._objects[-1] = keys | {key}
                    self._in_string = self._in_key = False
                    continue
                if self._in_key:
                    self._key.append(byte)
            elif byte == _QUOTE:
                top = self._objects[-1] if self._objects else None
                self._in_string, self._key = True, bytearray()
                self._in_key = top is not None and self._expect_key
            elif byte == ord("{"):
                self._objects.append(frozenset())
                self._expect_key = True
            elif byte == ord("["):
                self._objects.append(None)
            elif byte in (ord("}"), ord("]")):
                if self._objects:
                    self._objects.pop()
                self._expect_key = False
            elif byte == ord(","):
                self._expect_key = bool(self._objects) and self._objects[-1] is not None
            elif byte == ord(":"):
                self._expect_key = False
        return repeated

    def repeating(self, allowed: np.ndarray) -> np.ndarray:
        """``(num_repeating,)`` intp: the ids among ``allowed`` (a ``(vocab,)`` bool mask) whose bytes, followed
        from the current state, would close a key as one its object already holds. Does not change state."""
        # the fewest quotes a token needs to close a key: the key's own closing one (inside a key), an opening
        # and a closing one (outside strings), or one more to end a value string first; two more for a second key
        # of the token's own when no open object holds a key yet
        needed = 1 if self._in_key else 3 if self._in_string else 2
        needed += 0 if any(self._objects) else 2
        fits = self._quote_ids < len(allowed)
        ids, num_quotes = self._quote_ids[fits], self._num_quotes[fits]
        candidates = ids[allowed[ids] & (num_quotes >= needed)].tolist()
        return np.asarray([t for t in candidates if self._copy().feed(self._quote_bytes[t])], dtype=np.intp)

    def _copy(self) -> KeyGuard:
        """A guard in the same state that ``feed`` can move without moving this one (the key sets are shared:
        frozen, replaced when a key is added)."""
        other = object.__new__(KeyGuard)
        other._objects = list(self._objects)
        other._expect_key, other._in_string, other._in_key = self._expect_key, self._in_string, self._in_key
        other._escaped, other._key = self._escaped, bytearray(self._key)
        return other


def _decoded(raw: bytes) -> str:
    """A JSON string's value from its raw bytes between the quotes (escapes resolved); the raw text, read
    leniently, where it does not decode (the engine only writes valid JSON, so this is a fallback)."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "surrogateescape")
