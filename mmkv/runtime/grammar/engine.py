"""The grammar engine (llguidance): a tokenizer's ``Vocabulary``, grammars compiled once and cached by bytes,
and the ``GrammarConstraint`` one answer advances."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher

from ...errors import GrammarError
from ...toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from ..json_keys import KeyGuard

if TYPE_CHECKING:
    from ...model.handle import ModelHandle
from .limits import (
    COMPILED_BASE_BYTES,
    COMPILED_BYTES_PER_LARK_BYTE,
    END_OF_TURN,
    ENGINE_LIMITS,
    PROBE_STEPS,
    VISION_TOKENS,
    _heavy_turn,
    grammar_cache,
)
from .specs import (
    GrammarSpec,
)


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A tokenizer as the grammar engine sees it, sized to a model's vocabulary. Made by ``vocabulary()``."""

    engine: llguidance.LLTokenizer  # the engine's token table: ids below engine.vocab_size
    vocab_size: int  # the model's vocabulary (embedding rows): every mask has this length
    end_id: int  # the end of turn (<|im_end|>): allowed exactly when the answer is complete
    possible: torch.Tensor  # (vocab_size,) bool: False for ids never allowed (vision, past the tokenizer)
    tag_rules: str  # Lark rules tool_call_open / tool_call_close: the tag's token id if it is an added token
    # id -> bytes of every ordinary token holding a '"' (json_keys.KeyGuard's candidates)
    quote_tokens: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.possible.shape == (self.vocab_size,) and self.possible.dtype == torch.bool
        assert self.engine.vocab_size <= self.vocab_size and self.possible[self.end_id]


@functools.lru_cache(maxsize=8)
def vocabulary(
    tokenizer: Any,
    vocab_size: int | None = None,
    end_of_turn: str = END_OF_TURN,
    never: tuple[str, ...] = VISION_TOKENS,
) -> Vocabulary:
    """The engine's view of a fast Hugging Face tokenizer (cached per tokenizer object, size and tokens;
    building one walks the whole vocabulary). ``vocab_size``: the model's, when its embedding has more rows
    than the tokenizer has tokens (default: the tokenizer's). ``end_of_turn`` ends an answer and ``never`` are
    never allowed (defaults: the Qwen tokens; ``vocabulary_of`` passes the model family's). Raises
    ``ValueError`` when the tokenizer has no ``end_of_turn``."""
    added = tokenizer.get_added_vocab()  # token text -> id of every added (special or not) token
    if end_of_turn not in added:
        raise ValueError(
            f"the tokenizer has no {end_of_turn} token: constrained decoding needs the chat tokens"
        )
    engine = llguidance.hf.from_tokenizer(tokenizer, eos_token=added[end_of_turn])
    vocab_size = engine.vocab_size if vocab_size is None else int(vocab_size)
    if vocab_size < engine.vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than the tokenizer's {engine.vocab_size} tokens"
        )
    possible = torch.zeros(vocab_size, dtype=torch.bool)  # (vocab_size,)
    possible[: engine.vocab_size] = True
    for name in never:
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
    return Vocabulary(engine, vocab_size, added[end_of_turn], possible, tag_rules, quotes)


def vocabulary_of(handle: ModelHandle) -> Vocabulary:
    """``vocabulary`` of a loaded model: its tokenizer, its embedding's vocabulary size, its family's end of
    turn and vision tokens."""
    family = handle.family
    return vocabulary(
        handle.tokenizer, int(handle.text_config.vocab_size), family.end_of_turn, family.tokens.all
    )


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
    heavy turn until ``deadline``. A spec that joins others (``spec.parts``) compiles them first, so that an
    engine limit of either branch is refused here. Raises ``GrammarError`` (``GrammarTimeoutError`` past the
    deadline)."""
    key = ("compiled", vocab, spec)
    compiled = grammar_cache().get(key)
    if compiled is None:
        for part in spec.parts:
            compile_grammar(vocab, part, deadline)
        with _heavy_turn(deadline):
            compiled = grammar_cache().get(key) or build_grammar(vocab, spec)
        grammar_cache().put(
            key, compiled, COMPILED_BASE_BYTES + COMPILED_BYTES_PER_LARK_BYTE * len(spec.lark)
        )
    return compiled


def clear_caches() -> None:
    """Forget every cached vocabulary, spec and compiled grammar (benchmarks of cold costs, tests)."""
    vocabulary.cache_clear()
    grammar_cache().clear()


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
