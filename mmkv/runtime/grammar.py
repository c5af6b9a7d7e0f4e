"""Token constraints from grammars: which tokens may come next so that an answer is a JSON object, validates
against a JSON schema, or is one (or more) hermes tool calls of listed functions. Built on llguidance.

Three steps, each paying its own cost once:

1) a spec, ``json_object()``, ``json_schema(schema, strict)`` or ``tool_calls(tools, mode, parallel)``: a frozen
   record holding a Lark grammar (schemas inlined with ``%json``), validated when made: a ``GrammarError`` names
   the field and what to change;
2) ``compile_grammar(vocabulary(tokenizer, vocab_size), spec)``: the engine's parser for that tokenizer under
   ``ENGINE_LIMITS``, probed through its first forced tokens so that an engine limit is a ``GrammarError`` here
   and not mid-answer; specs and compiled grammars share one cache bounded by bytes (``set_cache_bytes``);
3) ``compiled.start()``: a fresh ``GrammarConstraint`` per answer (a copy of the compiled parser, microseconds)
   that the decode loop drives through the ``TokenConstraint`` protocol::

    constraint = constraint_for(handle, json_schema({"type": "object", ...}, strict=True))
    while not constraint.is_finished():
        logits[~constraint.allowed()] = float("-inf")     # (vocab,) bool, on the CPU
        token = int(logits.argmax())
        constraint.advance(token)                          # the end of turn too: then is_finished()

JSON is written compact with ``json.dumps``' default separators (``", "`` and ``": "``) and no other whitespace,
the text the Qwen templates render and the models are trained on; objects that declare properties admit no
others unless the schema says so (``json_schemas.close_objects``). ``<|im_end|>`` is allowed exactly when the
answer so far is complete; vision tokens, and ids past the tokenizer (padding rows of the embedding), never are;
nor is a token that would repeat a key in the object being written (``json_keys.KeyGuard``: llguidance cannot say
"unique keys" for free maps, so the constraint removes those tokens from its mask). Grammar work that holds a core
for long (a schema's checks, a compile) runs one at a time per process (``deadline``: how long a caller waits for
its turn; past it ``GrammarTimeoutError``). Knows nothing about models beyond a tokenizer and a vocabulary size.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher, LLParserLimits

from ..cache.memory import MemoryTier
from ..errors import GrammarError, GrammarTimeoutError
from ..toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from .json_keys import KeyGuard
from .json_schemas import check_schema, json_rule

if TYPE_CHECKING:
    from ..model.handle import ModelHandle

__all__ = [
    "CompiledGrammar",
    "GrammarConstraint",
    "GrammarSpec",
    "TokenConstraint",
    "Vocabulary",
    "DEFAULT_CACHE_BYTES",
    "ENGINE_LIMITS",
    "build_grammar",
    "clear_caches",
    "compile_grammar",
    "grammar_cache",
    "set_cache_bytes",
    "constraint_for",
    "json_object",
    "json_schema",
    "tool_calls",
    "tool_calls_or",
    "vocabulary",
    "vocabulary_of",
]

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


def _cached_spec(key: tuple, deadline: float | None, make) -> GrammarSpec:
    """The spec under ``key`` from the cache, else ``make()`` in the heavy turn, then cached."""
    spec = _cache.get(key)
    if spec is None:
        with _heavy_turn(deadline):
            spec = _cache.get(key) or make()  # (made by another thread meanwhile?)
        _cache.put(key, spec, sum(len(str(part)) for part in key) + 2 * len(spec.lark) + 256)
    return spec


@runtime_checkable
class TokenConstraint(Protocol):
    """Which tokens may come next in an answer; the decode loop's only view of a grammar."""

    def allowed(self) -> torch.Tensor:
        """``(vocab,)`` bool, CPU: the tokens allowed next. Does not change state."""
        ...

    def allowed_ids(self) -> torch.Tensor:
        """``(num_allowed,)`` int64, CPU, ascending: the ids ``allowed()`` marks. Does not change state."""
        ...

    def advance(self, token: int) -> None:
        """Take the chosen token (one ``allowed()`` marks); raises ``ValueError`` for any other."""
        ...

    def is_finished(self) -> bool:
        """Nothing but the end of turn can follow (or it was taken): the caller ends the answer."""
        ...


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer must be, as a Lark grammar for llguidance. Made (and validated) by ``json_object``,
    ``json_schema`` or ``tool_calls``; equal specs share one compiled grammar."""

    kind: GrammarKind  # which constructor made it
    lark: str  # the grammar; a tool-call grammar uses the rules tool_call_open / tool_call_close, left undefined
    label: str = field(default="", compare=False)  # for messages and logs: "tool_calls(named: wait)"
    warnings: tuple[str, ...] = field(default=(), compare=False)  # schema keywords ignored (not strict)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if not self.lark.startswith("start:"):
            raise ValueError(f"a grammar spec's Lark text starts with its start rule, got {self.lark[:40]!r}")


def _validated(kind: GrammarKind, lark: str, label: str, warnings: tuple[str, ...]) -> GrammarSpec:
    """The spec, after the whole grammar passes the engine's check (its parts were checked one by one)."""
    checked = lark + ("\n" + _TEXT_TAGS if kind == "tool_calls" else "")
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        LLMatcher.grammar_from_lark(checked), None, limits=ENGINE_LIMITS
    )
    if is_error:
        reason = messages[0].strip().splitlines()[0][:300]
        raise GrammarError(f"{label}: the grammar engine refused it: {reason}")
    return GrammarSpec(kind, lark, label, warnings)


def json_object(deadline: float | None = None) -> GrammarSpec:
    """Any JSON object (OpenAI ``response_format: {"type": "json_object"}``), its keys unique in each object."""
    lark = "start: " + json_rule({"type": "object"}, False)
    return _cached_spec(
        ("json_object",), deadline, lambda: _validated("json_object", lark, "json_object", ())
    )


def json_schema(schema: dict[str, Any], strict: bool = False, deadline: float | None = None) -> GrammarSpec:
    """JSON valid against ``schema`` (OpenAI ``response_format: json_schema``). ``strict``: refuse a keyword the
    engine cannot enforce (``uniqueItems``, ``if``/``then``, ``not``, ...); not strict: ignore it (listed in
    ``warnings``), so the output always parses but may break that keyword. Either way refused: a schema over
    ``json_schemas``' bounds, and one no finite value satisfies. Cached by its JSON text; the checks wait for the
    heavy turn until ``deadline``. Raises ``GrammarError`` (``GrammarTimeoutError`` past the deadline)."""
    where = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON object, got {type(schema).__name__}")
    text = json.dumps(schema)

    def make() -> GrammarSpec:
        warnings = tuple(f"{where}: {w}" for w in _checked(where, text, not strict))
        label = "json_schema(strict)" if strict else "json_schema"
        return _validated("json_schema", "start: " + json_rule(schema, not strict), label, warnings)

    return _cached_spec(("json_schema", text, bool(strict)), deadline, make)


def _function(index: int, tool: Any) -> tuple[str, dict[str, Any], bool]:
    """(name, parameters schema, strict) of ``tools[index]``, an OpenAI tool or a bare function."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise GrammarError(
            f"{where} must be an object like {{'type': 'function', 'function': {{'name': ...}}}}"
        )
    if tool.get("type", "function") != "function":
        raise GrammarError(f"{where}.type must be 'function', got {tool.get('type')!r}")
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise GrammarError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    parameters = function.get("parameters")
    if parameters is None:  # OpenAI: no parameters is an empty parameter list
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise GrammarError(f"{where}.function.parameters must be a JSON schema of type 'object' ({name!r})")
    return name, {"type": "object", **parameters}, bool(function.get("strict", False))


def _chosen_name(mode: Any, names: list[str]) -> str | None:
    """The one function a named tool choice allows, or None for ``required`` (any listed)."""
    if mode == "required":
        return None
    if isinstance(mode, str):
        raise GrammarError(
            f"tool_choice {mode!r} does not constrain decoding: use 'required' or {{'name': ...}} "
            "(parse free output with mmkv.toolcalls.parse_tool_calls)"
        )
    inner = mode.get("function", mode) if isinstance(mode, dict) else None
    name = inner.get("name") if isinstance(inner, dict) else None
    if not isinstance(name, str):
        raise GrammarError(f"tool_choice must be 'required' or {{'name': <function name>}}, got {mode!r}")
    if name not in names:
        raise GrammarError(f"tool_choice names {name!r}, which is not in tools ({', '.join(names)}); list it")
    return name


def tool_calls(
    tools: list[dict[str, Any]], mode: Any = "required", parallel: bool = False, deadline: float | None = None
) -> GrammarSpec:
    """The answer IS hermes tool call(s) as the Qwen templates render them (``toolcalls.format_tool_calls``):
    ``<tool_call>\\n{"name": "<listed name>", "arguments": <valid JSON>}\\n</tool_call>``, one, or with
    ``parallel`` (and ``required``) one or more joined by newlines. ``mode``: ``"required"`` (any listed function)
    or ``{"name": ...}`` (exactly one call of that one, whatever ``parallel``, as OpenAI and vLLM answer; OpenAI's
    ``{"type": "function", "function": {"name": ...}}`` too). A function's ``strict`` decides, as in
    ``json_schema``, whether unenforceable keywords are refused or ignored; every listed function's parameters
    are checked whatever the mode (the same list gets the same verdict). Cached by its JSON text; the checks wait
    for the heavy turn until ``deadline``. Raises ``GrammarError`` for an empty list, a duplicate or unlisted
    name, an invalid parameters schema (``GrammarTimeoutError`` past the deadline)."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise GrammarError(
            "tools must be a non-empty list of functions when tool_choice is 'required' or named"
        )
    functions = [_function(i, tool) for i, tool in enumerate(tools)]
    names = [name for name, _, _ in functions]
    if len(set(names)) < len(names):
        raise GrammarError(f"tools lists a function name twice ({', '.join(names)}); names must be unique")
    chosen = _chosen_name(mode, names)
    parallel = bool(parallel) and chosen is None
    texts = [json.dumps(parameters) for _, parameters, _ in functions]

    def make() -> GrammarSpec:
        rules, alternatives, warnings = [], [], []
        for i, ((name, parameters, strict), text) in enumerate(zip(functions, texts, strict=True)):
            where = f"tools[{i}].function.parameters"
            warnings += [f"{where}: {w}" for w in _checked(where, text, not strict)]
            if chosen is not None and name != chosen:
                continue
            head = json.dumps(f'\n{{"name": "{name}", "arguments": ')
            rules.append(f'call_{i}: tool_call_open {head} args_{i} "}}\\n" tool_call_close')
            rules.append(f"args_{i}: {json_rule(parameters, not strict)}")
            alternatives.append(f"call_{i}")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        lark = "\n".join([start, "call: " + " | ".join(alternatives), *rules]) + "\n"
        listed = names if chosen is None else [chosen]
        label = f"tool_calls({'required' if chosen is None else 'named'}: {', '.join(listed)})"
        return _validated("tool_calls", lark, label + (" parallel" if parallel else ""), tuple(warnings))

    strictness = json.dumps([strict for _, _, strict in functions])
    key = ("tool_calls", json.dumps(names), strictness, *texts, chosen, parallel)
    return _cached_spec(key, deadline, make)


def tool_calls_or(
    tools_spec: GrammarSpec, answer_spec: GrammarSpec, deadline: float | None = None
) -> GrammarSpec:
    """An answer that is either the tool call(s) ``tools_spec`` allows or what ``answer_spec`` (a JSON object or
    schema) allows: ``tool_choice: "auto"`` with a ``response_format``, where the model may call a tool or answer
    in the format. Raises ``GrammarError`` (as its parts would)."""
    if tools_spec.kind != "tool_calls" or answer_spec.kind == "tool_calls":
        raise ValueError("tool_calls_or takes a tool_calls spec and a json spec")

    def make() -> GrammarSpec:
        tools_head, *tools_rules = tools_spec.lark.strip().split("\n")
        answer_head, *answer_rules = answer_spec.lark.strip().split("\n")
        lark = "\n".join([
            "start: calls | answer", "calls:" + tools_head[len("start:"):], "answer:" + answer_head[len("start:"):],
            *tools_rules, *answer_rules,
        ]) + "\n"  # fmt: skip
        label = f"{tools_spec.label} or {answer_spec.label}"
        return _validated("tool_calls", lark, label, tools_spec.warnings + answer_spec.warnings)

    return _cached_spec(("tool_calls_or", tools_spec.lark, answer_spec.lark), deadline, make)


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A tokenizer as the grammar engine sees it, sized to a model's vocabulary. Made by ``vocabulary()``."""

    engine: llguidance.LLTokenizer  # the engine's token table: ids below engine.vocab_size
    vocab_size: int  # the model's vocabulary (embedding rows): every mask has this length
    end_id: int  # <|im_end|>: allowed exactly when the answer is complete
    possible: torch.Tensor  # (vocab_size,) bool: False for ids never allowed (vision, past the tokenizer)
    tag_rules: str  # Lark rules tool_call_open / tool_call_close: the tag's token id if it is an added token
    # id -> bytes of every ordinary token holding a '"' (json_keys.KeyGuard's candidates)
    quote_tokens: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.possible.shape == (self.vocab_size,) and self.possible.dtype == torch.bool
        assert self.engine.vocab_size <= self.vocab_size and self.possible[self.end_id]


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer: Any, vocab_size: int | None = None) -> Vocabulary:
    """The engine's view of a fast Hugging Face tokenizer (cached per tokenizer object and size; building one
    walks the whole vocabulary). ``vocab_size``: the model's, when its embedding has more rows than the
    tokenizer has tokens (default: the tokenizer's). Raises ``ValueError`` without ``<|im_end|>``."""
    added = tokenizer.get_added_vocab()  # token text -> id of every added (special or not) token
    if END_OF_TURN not in added:
        raise ValueError(
            f"the tokenizer has no {END_OF_TURN} token: constrained decoding needs the Qwen chat tokens"
        )
    engine = llguidance.hf.from_tokenizer(tokenizer, eos_token=added[END_OF_TURN])
    vocab_size = engine.vocab_size if vocab_size is None else int(vocab_size)
    if vocab_size < engine.vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than the tokenizer's {engine.vocab_size} tokens"
        )
    possible = torch.zeros(vocab_size, dtype=torch.bool)  # (vocab_size,)
    possible[: engine.vocab_size] = True
    for name in VISION_TOKENS:
        if name in added:
            possible[added[name]] = False
    # llguidance reads every added token as a special one, and its canonical tokenization of a forced "<tool_call>"
    # offers the added token, then refuses it as text: name the token itself where the tokenizer has one
    tags = {
        tag: f"<[{added[tag]}]>" if tag in added else json.dumps(tag)
        for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    }
    tag_rules = f"tool_call_open: {tags[TOOL_CALL_OPEN]}\ntool_call_close: {tags[TOOL_CALL_CLOSE]}\n"
    quotes = {}  # the tokens that can end a key (KeyGuard's candidates): one pass over the vocabulary
    for token in range(engine.vocab_size):
        data = engine.decode_bytes([token])
        if b'"' in data and not engine.is_special_token(token):
            quotes[token] = data
    return Vocabulary(engine, vocab_size, added[END_OF_TURN], possible, tag_rules, quotes)


def vocabulary_of(handle: ModelHandle) -> Vocabulary:
    """``vocabulary`` of a loaded model: its tokenizer, its embedding's vocabulary size."""
    return vocabulary(handle.tokenizer, int(handle.text_config.vocab_size))


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one vocabulary; ``start()`` begins an answer. Made by ``compile_grammar``."""

    vocab: Vocabulary  # the vocabulary it was compiled for
    spec: GrammarSpec  # what it enforces
    initial: LLMatcher  # the engine's parser before any token; never advanced (start() copies it)

    def start(self) -> GrammarConstraint:
        """A fresh constraint at the start of an answer (copies the parser; the lexer's caches are shared)."""
        return GrammarConstraint(self.vocab, self.initial.deep_copy(), self.spec.label)


def build_grammar(vocab: Vocabulary, spec: GrammarSpec) -> CompiledGrammar:
    """The engine's parser for ``spec`` over ``vocab``, uncached (``compile_grammar`` caches it), probed: its
    first masks are computed through up to ``PROBE_STEPS`` forced runs (an object's ``{``, a call's tag and
    name), where an engine limit (a row of too many items: thousands of optional properties; a lexer too
    complex: a huge constant) shows, so that it is refused here rather than mid-answer. The engine drops the GIL
    while it builds. Raises ``GrammarError``."""
    lark = spec.lark + ("\n" + vocab.tag_rules if spec.kind == "tool_calls" else "")
    matcher = LLMatcher(vocab.engine, LLMatcher.grammar_from_lark(lark), log_level=0, limits=ENGINE_LIMITS)
    probe = matcher.deep_copy() if not matcher.is_error() else matcher
    for _ in range(PROBE_STEPS):
        if probe.is_error():
            break
        probe.compute_bitmask()
        forced = [] if probe.is_error() else probe.compute_ff_tokens()
        if not forced or not probe.consume_tokens(forced):
            break
    if probe.is_error() or matcher.is_error():
        reason = (matcher.get_error() or probe.get_error()).strip().splitlines()[0][:300]
        raise GrammarError(f"{spec.label} cannot be enforced: the grammar engine refused it: {reason}; "
                           "send a simpler schema (fewer optional properties, shorter constants)")  # fmt: skip
    return CompiledGrammar(vocab, spec, matcher)


def compile_grammar(vocab: Vocabulary, spec: GrammarSpec, deadline: float | None = None) -> CompiledGrammar:
    """``build_grammar`` once per (vocabulary, spec), kept in the grammar cache (declared at
    ``COMPILED_BASE_BYTES + COMPILED_BYTES_PER_LARK_BYTE`` per byte of its Lark text); a compile waits for the
    heavy turn until ``deadline``. Raises ``GrammarError`` (``GrammarTimeoutError`` past the deadline)."""
    key = ("compiled", vocab, spec)
    compiled = _cache.get(key)
    if compiled is None:
        with _heavy_turn(deadline):
            compiled = _cache.get(key) or build_grammar(vocab, spec)
        _cache.put(key, compiled, COMPILED_BASE_BYTES + COMPILED_BYTES_PER_LARK_BYTE * len(spec.lark))
    return compiled


def clear_caches() -> None:
    """Forget every cached vocabulary, spec and compiled grammar (benchmarks of cold costs, tests)."""
    vocabulary.cache_clear()
    _cache.clear()


def constraint_for(
    handle: ModelHandle, spec: GrammarSpec, deadline: float | None = None
) -> GrammarConstraint:
    """A fresh constraint for one answer of ``handle``'s model (compiled once, then cached)."""
    return compile_grammar(vocabulary_of(handle), spec, deadline).start()


class GrammarConstraint:
    """One answer's progress through a grammar (a ``TokenConstraint``). Owns an engine parser that only
    ``advance`` moves; ``allowed`` computes the mask once per state. When the engine stops on a limit mid-answer,
    or nothing at all is left to allow, ``allowed`` / ``advance`` raise ``GrammarError`` (the server answers
    400, or ends a stream with that error)."""

    def __init__(self, vocab: Vocabulary, matcher: LLMatcher, label: str = "grammar") -> None:
        self.vocab = vocab
        self.label = label  # the spec's, for errors
        self._matcher = matcher
        self._possible = vocab.possible.numpy()  # (vocab_size,) bool, shares the vocabulary's memory
        self._mask: np.ndarray | None = None  # (vocab_size,) bool of the current state, until advance
        self._keys = KeyGuard(vocab.quote_tokens)  # the keys of the objects being written
        self._ended = False  # the end of turn was taken
        self.num_tokens = 0  # tokens taken so far, the end of turn included

    def _stopped(self, why: str) -> GrammarError:
        reason = why.strip().splitlines()[0][:300] if why.strip() else "no token can follow"
        return GrammarError(
            f"{self.label} cannot be enforced: the grammar engine stopped after {self.num_tokens} tokens: "
            f"{reason}; send a simpler schema"
        )

    def _current(self) -> np.ndarray:
        """The mask of the current state, computed on first use (numpy: a few microseconds cheaper than torch
        per operation, which matters at one call per token). Raises ``GrammarError`` if the engine stopped."""
        if self._mask is None:
            mask = np.zeros(self.vocab.vocab_size, dtype=np.bool_)  # (vocab_size,)
            if not self._ended:
                n = self.vocab.engine.vocab_size
                words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)  # (ceil(n / 32) * 4,)
                if self._matcher.is_error():
                    raise self._stopped(self._matcher.get_error())
                bits = np.unpackbits(words, count=n, bitorder="little").view(np.bool_)  # (n,)
                np.logical_and(bits, self._possible[:n], out=mask[:n])
                mask[self._keys.repeating(mask)] = False
                if not mask.any():
                    raise self._stopped("every token it allows would repeat a key of the object")
            self._mask = mask
        return self._mask

    def allowed(self) -> torch.Tensor:
        """``(vocab_size,)`` bool on the CPU: the tokens allowed next (none once the end of turn was taken).
        Computed once per state; a mask once returned is never changed (do not change it in place either)."""
        return torch.from_numpy(self._current())

    def allowed_ids(self) -> torch.Tensor:
        """``(num_allowed,)`` int64 on the CPU, ascending: the ids ``allowed()`` marks. Cheaper to apply to a
        large vocabulary than the mask: greedy is ``ids[logits[ids].argmax()]``, sampling draws from
        ``logits[ids]``. Does not change state."""
        return torch.from_numpy(np.flatnonzero(self._current()))

    def advance(self, token: int) -> None:
        """Take ``token``; raises ``ValueError`` (state unchanged) unless ``allowed()[token]``, and
        ``GrammarError`` if the engine stops on it."""
        token = int(token)
        if not 0 <= token < self.vocab.vocab_size or not self._current()[token]:
            state = "the answer already ended" if self._ended else f"after {self.num_tokens} tokens"
            raise ValueError(f"token {token} is not allowed by the grammar ({state})")
        if not self._matcher.consume_token(token):
            raise self._stopped(self._matcher.get_error())
        if not self.vocab.engine.is_special_token(token):
            self._keys.feed(self.vocab.engine.decode_bytes([token]))
        self._ended = token == self.vocab.end_id
        self._mask = None
        self.num_tokens += 1

    def is_accepting(self) -> bool:
        """The answer so far is complete: the end of turn is allowed (more tokens may be too)."""
        return self._ended or self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """Nothing but the end of turn can follow, or it was taken: end the answer."""
        return self._ended or self._matcher.is_stopped()
