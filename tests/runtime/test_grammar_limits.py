"""The grammar surface's bounds, below the server: a schema past what the engine can enforce is a
``GrammarError`` saying it "cannot be enforced" (whichever builder is given it), grammar work waits for its
one-at-a-time turn no longer than its deadline (``GrammarTimeoutError``), the grammar cache never holds more
declared bytes than its bound, and a single-call tool grammar never admits a second call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import mmkv
from mmkv.errors import GrammarError, GrammarTimeoutError, MmkvError
from mmkv.runtime.grammar import (
    COMPILED_BASE_BYTES,
    COMPILED_BYTES_PER_LARK_BYTE,
    DEFAULT_CACHE_BYTES,
    compile_grammar,
    grammar_cache,
    json_schema,
    limits,
    set_cache_bytes,
    tool_calls,
    tool_calls_or,
    vocabulary_of,
)
from mmkv.runtime.json_schemas import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, _check_bounds
from mmkv.toolcalls import parse_tool_calls
from tests.helpers import LIMITS, fresh, nested_any_of


@pytest.fixture(scope="module")
def handle() -> mmkv.ModelHandle:
    return mmkv.load("tiny-qwen3-vl", device="cpu")


def built(schema: dict, how: str, handle: mmkv.ModelHandle):
    """The grammar for ``schema`` as ``how`` asks (a response format, a tool's parameters under a required or
    a named choice, a response format that a small tool's call may replace: tool_choice auto), compiled for
    ``handle``'s tokenizer."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    small = [{"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    spec = {
        "json_schema": lambda: json_schema(schema),
        "required": lambda: tool_calls(tools, "required", parallel=True),
        "named": lambda: tool_calls(tools, {"name": "f"}),
        "tools or json_schema": lambda: tool_calls_or(tool_calls(small, "required"), json_schema(schema)),
    }[how]()
    return compile_grammar(vocabulary_of(handle), spec)


HOWS = ["json_schema", "required", "named", "tools or json_schema"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("form", list(LIMITS))
def test_a_schema_past_the_engines_limits_cannot_be_enforced(handle, form, how):
    """Recursion with no way out (a required $ref cycle, the root, two definitions naming each other), more
    properties than the node bound or the engine's row of items, anyOf nested past the depth bound: each a
    GrammarError saying "cannot be enforced" and what to send instead, when compiled (not mid-answer), as a
    response format, as a tool's parameters under either choice, and as the format a tool call may replace
    (whose grammar starts with a choice: no forced token to probe through); never another exception."""
    with pytest.raises(GrammarError, match="cannot be enforced") as caught:
        built(fresh(LIMITS[form]), how, handle)
    message = str(caught.value)
    assert any(words in message for words in ("send a s", "give the recursion an end")), message


def test_a_constant_of_a_megabyte_cannot_be_enforced(handle):
    """A 1 MB const is refused when compiled (the engine's lexer bound: "too many expressions"), as a
    GrammarError saying "cannot be enforced" and to send shorter constants (as a branch too: the server's
    tests); the engine is usable after."""
    schema = {"type": "object", "properties": {"x": {"const": "ab" * 500_000}}, "required": ["x"]}
    with pytest.raises(GrammarError, match="cannot be enforced.*shorter constants"):
        built(fresh(schema), "json_schema", handle)
    small = {"type": "object", "properties": {"x": {"const": "ab"}}, "required": ["x"]}
    assert built(fresh(small), "json_schema", handle).start().allowed().any()


def test_the_bounds_are_the_ones_said():
    """Exactly MAX_SCHEMA_NODES objects and arrays, and exactly MAX_SCHEMA_DEPTH levels, pass the bounds; one
    more of either is refused saying which bound (through json_schema too)."""

    def properties(num_nodes: int) -> dict:  # the root, its properties, and num_nodes - 2 property schemas
        return {"type": "object", "properties": {f"p{i}": {} for i in range(num_nodes - 2)}}

    def nested(depth: int) -> dict:
        schema: dict = {}
        for _ in range(depth - 1):
            schema = {"items": schema}
        return schema

    _check_bounds("s", properties(MAX_SCHEMA_NODES))
    _check_bounds("s", nested(MAX_SCHEMA_DEPTH))
    with pytest.raises(
        GrammarError, match=f"s cannot be enforced: it holds more than {MAX_SCHEMA_NODES:,} objects"
    ):
        _check_bounds("s", properties(MAX_SCHEMA_NODES + 1))
    with pytest.raises(GrammarError, match=f"nested deeper than {MAX_SCHEMA_DEPTH}; send a smaller schema"):
        _check_bounds("s", nested(MAX_SCHEMA_DEPTH + 1))
    with pytest.raises(
        GrammarError, match=f"schema cannot be enforced: .* nested deeper than {MAX_SCHEMA_DEPTH}"
    ):
        json_schema(fresh(nested_any_of(MAX_SCHEMA_DEPTH // 2)))  # 2 * 32 + 1 levels


# ---- the one turn at heavy grammar work ----


def raised_in_a_thread(call, *args, within_s: float) -> BaseException | None:
    """What ``call(*args)`` raised, run on a thread that must end within ``within_s`` (a wait that ignored its
    deadline fails the test instead of hanging it)."""
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call(*args)
        except BaseException as exc:
            raised[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"still waiting after {within_s} s"
    return raised[0]


def test_waiting_for_the_turn_ends_at_the_deadline(handle):
    """While another holds the turn, checking a new schema and compiling a checked one each wait until their
    deadline and raise GrammarTimeoutError (a TimeoutError and an MmkvError, saying it timed out); a spec
    already made needs no turn, even past its deadline."""
    vocab = vocabulary_of(handle)
    schema = fresh({"type": "object", "properties": {"a": {"type": "integer"}}})
    made = json_schema(schema)
    assert limits._heavy.acquire(timeout=60), "the heavy turn was not free"  # (as another request's schema)
    try:
        for build in (
            lambda deadline: json_schema(fresh({"type": "object"}), deadline=deadline),
            lambda deadline: compile_grammar(vocab, made, deadline),
        ):
            started = time.monotonic()
            error = raised_in_a_thread(build, started + 0.2, within_s=30)
            assert 0.19 <= time.monotonic() - started
            assert isinstance(error, GrammarTimeoutError) and "timed out" in str(error)
            assert isinstance(error, TimeoutError) and isinstance(error, MmkvError)
        assert json_schema(dict(schema), deadline=time.monotonic()) is made
    finally:
        limits._heavy.release()


def test_the_turn_is_one_at_a_time_and_handed_on(monkeypatch):
    """Three threads checking new schemas at once take the turn one after the other (never both inside), and a
    waiter gets it when the holder lets go (within its deadline)."""
    inside, most = [0], [0]
    lock = threading.Lock()
    check = limits.check_schema

    def counting(*args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.05)  # (long enough for the other thread to arrive)
            return check(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(limits, "check_schema", counting)
    specs = []
    threads = [threading.Thread(target=lambda: specs.append(json_schema(fresh({"type": "object"}),
                                deadline=time.monotonic() + 60))) for _ in range(3)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(specs) == 3 and most[0] == 1


# ---- the grammar cache's byte bound ----


@pytest.fixture
def small_cache():
    """A grammar cache of 6 MB for the test; the default bound (and an empty cache) after it."""
    set_cache_bytes(6 << 20)
    yield 6 << 20
    set_cache_bytes(DEFAULT_CACHE_BYTES)


def test_the_cache_never_holds_more_than_its_bound(small_cache, handle):
    """Distinct schemas with 4 kB constants (each compiled grammar declared at about 1.9 MB): after every
    compile the cache holds at most its bound, old grammars are evicted (counted), and an evicted grammar is
    compiled again when asked (a miss, not an error)."""
    vocab = vocabulary_of(handle)
    evictions = grammar_cache().evictions
    schemas = [{"type": "object", "properties": {"x": {"const": f"{k}" * 4000}}, "required": ["x"]}
               for k in range(8)]  # fmt: skip
    compiled = []
    for schema in schemas:
        compiled.append(compile_grammar(vocab, json_schema(schema)))
        assert 0 < grammar_cache().bytes <= small_cache
    declared = COMPILED_BASE_BYTES + COMPILED_BYTES_PER_LARK_BYTE * len(compiled[0].spec.lark)
    assert grammar_cache().evictions - evictions >= len(schemas) - small_cache // declared
    first = compile_grammar(vocab, json_schema(schemas[0]))
    assert first is not compiled[0] and first.spec == compiled[0].spec  # (compiled again)
    assert grammar_cache().bytes <= small_cache


def test_a_grammar_bigger_than_the_bound_is_used_but_not_held(handle):
    """With a bound under one compiled grammar's declared size, a compile still returns a working grammar and
    the cache stays empty of it."""
    set_cache_bytes(COMPILED_BASE_BYTES // 2)
    try:
        compiled = compile_grammar(vocabulary_of(handle), json_schema({"type": "object"}))
        assert compiled.start().allowed().any()
        assert grammar_cache().bytes <= COMPILED_BASE_BYTES // 2
    finally:
        set_cache_bytes(DEFAULT_CACHE_BYTES)


def test_the_cache_has_a_default_bound_and_refuses_a_negative_one():
    """The default bound is 256 MiB (the server's default too); a negative bound is a ValueError."""
    from mmkv.serve.config import ServerConfig

    assert DEFAULT_CACHE_BYTES == 256 << 20 == ServerConfig(model="m").grammar_cache_bytes
    assert grammar_cache().max_bytes == DEFAULT_CACHE_BYTES
    with pytest.raises(ValueError, match="max_bytes"):
        set_cache_bytes(-1)
    assert grammar_cache().max_bytes == DEFAULT_CACHE_BYTES


# ---- one call means one call ----

WAIT = {"type": "function", "function": {"name": "wait", "parameters": {"type": "object", "properties": {}}}}
CLICK = {"type": "function", "function": {"name": "click", "parameters": {"type": "object", "properties": {
    "target": {"enum": ["ok", "no"]}}, "required": ["target"]}}}  # fmt: skip


def calls_written(handle: mmkv.ModelHandle, mode, parallel: bool, max_steps: int = 400) -> tuple[int, str]:
    """Drive a tool-call grammar with logits that favour a newline (the separator of parallel calls) and
    disfavour the end of turn; the number of calls written and the text."""
    vocab = vocabulary_of(handle)
    constraint = compile_grammar(vocab, tool_calls([WAIT, CLICK], mode, parallel)).start()
    logits = torch.zeros(vocab.vocab_size)  # (vocab,)
    logits[handle.tokenizer.encode("\n")] = 10.0
    logits[vocab.end_id] = -10.0
    ids = []
    while not constraint.is_finished() and len(ids) < max_steps:
        token = int(logits.masked_fill(~constraint.allowed(), float("-inf")).argmax())
        constraint.advance(token)
        ids.append(token)
    text = handle.tokenizer.decode(ids, skip_special_tokens=True)
    return text.count("<tool_call>"), text


@pytest.mark.parametrize(
    "mode, parallel", [("required", False), ({"name": "click"}, False), ({"name": "click"}, True)]
)
def test_a_single_call_grammar_ends_after_one_call(handle, mode, parallel):
    """Required without parallel calls, and a named choice whatever ``parallel``: pushed towards a second
    call, the answer is exactly one call (of the named function when named) and ends."""
    count, text = calls_written(handle, mode, parallel)
    parsed = parse_tool_calls(text)
    assert count == 1 and len(parsed.calls) == 1 and not parsed.malformed, text
    if isinstance(mode, dict):
        assert parsed.calls[0].name == "click" and parsed.calls[0].arguments["target"] in ("ok", "no")


def test_parallel_calls_are_written_when_allowed(handle):
    """The same push under required with parallel calls writes more than one (so the test above can fail)."""
    count, text = calls_written(handle, "required", True, max_steps=150)
    assert count >= 2, text
