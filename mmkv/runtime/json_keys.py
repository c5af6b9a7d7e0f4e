"""``KeyGuard``: unique keys in the JSON objects of a constrained answer.

llguidance writes declared properties once each, but a free map (``json_object``, ``additionalProperties``) may
repeat a key, ``{"note": 1, "note": 1}``: JSON that a strict parser (unique keys) refuses and that ``json.loads``
silently reads as its last value. A grammar cannot say "a key not written before" (the language is not
context-free), so the guard follows the answer's bytes instead, knows the keys of every object being written,
and, while a key is being written, names the tokens whose closing quote would finish one already there; the
constraint removes them from its mask. The key is compared decoded (``"a"`` and ``"\\u0061"`` are the same).
Knows nothing about grammars beyond the bytes of tokens; text outside JSON (tool-call tags) holds no quotes.

    guard = KeyGuard({7: b'"', 8: b'a"'})   # token id -> bytes, for the tokens holding a quote
    guard.feed(b'{"a": 1, "')                 # inside a new key of an object holding "a"
    guard.repeating(mask)                     # array([8]): 'a"' would write "a" again; '"' (the key "") is fine
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
        self._quote_bytes = quote_tokens  # id -> the token's bytes
        # the open containers, innermost last: an object's keys so far, or None for an array
        self._objects: list[set[str] | None] = []
        self._expect_key = False  # the innermost object's next string is a key
        self._in_string = False  # inside a string
        self._in_key = False  # ... and it is a key of the innermost object
        self._escaped = False  # the last byte of the string so far is an unfinished backslash escape
        self._key = bytearray()  # the raw bytes of the key being written (escapes as written)

    def feed(self, data: bytes) -> None:
        """Follow the bytes of one more token of the answer."""
        for byte in data:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif byte == _BACKSLASH:
                    self._escaped = True
                elif byte == _QUOTE:
                    if self._in_key and self._objects and self._objects[-1] is not None:
                        self._objects[-1].add(_decoded(bytes(self._key)))
                    self._in_string = self._in_key = False
                    continue
                if self._in_key:
                    self._key.append(byte)
            elif byte == _QUOTE:
                top = self._objects[-1] if self._objects else None
                self._in_string, self._key = True, bytearray()
                self._in_key = top is not None and self._expect_key
            elif byte == ord("{"):
                self._objects.append(set())
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

    def repeating(self, allowed: np.ndarray) -> np.ndarray:
        """``(num_repeating,)`` intp: the ids among ``allowed`` (a ``(vocab,)`` bool mask) whose bytes would close
        the key being written as one its object already has; empty outside a key. Does not change state."""
        keys = self._objects[-1] if self._in_key and self._objects else None
        if not keys:
            return np.empty(0, dtype=np.intp)
        ids = self._quote_ids[self._quote_ids < len(allowed)]
        out = []
        for token in ids[allowed[ids]].tolist():
            data, escaped = self._quote_bytes[token], self._escaped
            for i, byte in enumerate(data):
                if escaped:
                    escaped = False
                elif byte == _BACKSLASH:
                    escaped = True
                elif byte == _QUOTE:
                    if _decoded(bytes(self._key) + data[:i]) in keys:
                        out.append(token)
                    break
        return np.asarray(out, dtype=np.intp)


def _decoded(raw: bytes) -> str:
    """A JSON string's value from its raw bytes between the quotes (escapes resolved); the raw text, read
    leniently, where it does not decode (the engine only writes valid JSON, so this is a fallback)."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "surrogateescape")
