"""The grammar engine's limits and the grammar cache: bounds on compiled grammars, the one turn for heavy
grammar work, and the spec checks the builders share."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from llguidance import LLParserLimits

from ...cache.memory import MemoryTier
from ...errors import GrammarTimeoutError
from ...toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from ..json_schemas import check_schema

if TYPE_CHECKING:
    pass

END_OF_TURN = "<|im_end|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
GrammarKind = Literal["json_object", "json_schema", "tool_calls"]
_KINDS = ("json_object", "json_schema", "tool_calls")
# the tags as text, for checking a tool-call grammar without a tokenizer (compile_grammar defines them per tokenizer)
_TEXT_TAGS = f"tool_call_open: {json.dumps(TOOL_CALL_OPEN)}\ntool_call_close: {json.dumps(TOOL_CALL_CLOSE)}\n"
# the engine's bounds on one grammar (llguidance's defaults, but fewer lexer states: each costs 1-2 kB and a grammar's
# lexer grows as answers use it, so this caps what one cached grammar can come to hold); past one, it stops with an
# error that becomes a GrammarError. verbose_errors off: an error never quotes the grammar (the client's schema).
ENGINE_LIMITS = LLParserLimits(max_lexer_states=50_000, verbose_errors=False)
# forced runs a compiled grammar is advanced through when compiled (an object's "{" first)
PROBE_STEPS = 8
DEFAULT_CACHE_BYTES = 256 << 20  # the grammar cache's default bound (``set_cache_bytes``; mmkv serve's flag)
# what a compiled grammar is declared to hold, for the cache's bound: measured about 330 bytes of the engine's
# memory (its lexer, after the first masks) per byte of Lark text for long constants, much less for most schemas
COMPILED_BYTES_PER_LARK_BYTE = 400
COMPILED_BASE_BYTES = 256 << 10
# specs by their inputs, checked schemas by their text, compiled grammars by (vocabulary, spec)
_cache: MemoryTier = MemoryTier(DEFAULT_CACHE_BYTES)
_heavy = threading.BoundedSemaphore(1)  # grammar work that holds a core: one at a time per process


def set_cache_bytes(max_bytes: int) -> None:
    """Bound the grammar cache (specs and compiled grammars together, LRU by declared bytes) at ``max_bytes``,
    dropping what it holds. A process-wide cache: ``mmkv serve --grammar-cache-bytes`` calls this once."""
    global _cache
    _cache = MemoryTier(max_bytes)


def grammar_cache() -> MemoryTier:
    """The grammar cache (for its counters: ``hits``, ``misses``, ``evictions``, ``bytes``). Read only."""
    return _cache


@contextlib.contextmanager
def _heavy_turn(deadline: float | None) -> Iterator[None]:
    """Hold the one turn at heavy grammar work, waiting until ``deadline`` (``time.monotonic()``) at most.
    Raises ``GrammarTimeoutError`` if the turn does not come by then."""
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not _heavy.acquire(timeout=-1 if wait is None else wait):
        raise GrammarTimeoutError("the request timed out while its grammar waited for others' schemas")
    try:
        yield
    finally:
        _heavy.release()


def _checked(where: str, text: str, lenient: bool) -> tuple[str, ...]:
    """``check_schema``'s warnings for one schema's JSON text, cached (a tool list checked for ``required`` is
    not checked again for a named choice); its refusals are not cached (they raise again)."""
    key = ("checked", text, lenient)
    warnings = _cache.get(key)
    if warnings is None:
        warnings = check_schema(where, text, lenient)
        _cache.put(key, warnings, len(text) + sum(len(w) for w in warnings) + 256)
    return warnings


def _cached_spec(key: tuple, deadline: float | None, make) -> Any:  # a GrammarSpec (specs.py)
    """The spec under ``key`` from the cache, else ``make()`` in the heavy turn, then cached."""
    spec = _cache.get(key)
    if spec is None:
        with _heavy_turn(deadline):
            spec = _cache.get(key) or make()  # (made by another thread meanwhile?)
        _cache.put(key, spec, sum(len(str(part)) for part in key) + 2 * len(spec.lark) + 256)
    return spec
