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

from .engine import (
    CompiledGrammar,
    GrammarConstraint,
    Vocabulary,
    build_grammar,
    clear_caches,
    compile_grammar,
    constraint_for,
    vocabulary,
    vocabulary_of,
)
from .limits import (
    COMPILED_BASE_BYTES,
    COMPILED_BYTES_PER_LARK_BYTE,
    DEFAULT_CACHE_BYTES,
    END_OF_TURN,
    ENGINE_LIMITS,
    PROBE_STEPS,
    TOOL_NAME,
    VISION_TOKENS,
    GrammarKind,
    grammar_cache,
    set_cache_bytes,
)
from .specs import (
    GrammarSpec,
    TokenConstraint,
    json_object,
    json_schema,
    tool_calls,
    tool_calls_or,
)

__all__ = [
    "COMPILED_BASE_BYTES",
    "COMPILED_BYTES_PER_LARK_BYTE",
    "END_OF_TURN",
    "PROBE_STEPS",
    "TOOL_NAME",
    "VISION_TOKENS",
    "GrammarKind",
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
