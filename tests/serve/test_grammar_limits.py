"""The grammar surface of the server (an in-process app on tiny-qwen3-vl), per class of defect: a schema the
engine cannot enforce is a 400 saying so, never a 500, and changes nothing; grammar work runs off the event loop;
a schema waiting for the one heavy turn ends at the request's deadline (504) while plain requests are answered;
oversized schemas are refused before any model work; the grammar cache's flag is checked; JSON answers are strict
JSON; the same tools get the same verdict whatever the tool choice, and a single-call choice gets one call; and
random schemas, as formats and as tools, never get a 5xx or stall the server."""

from __future__ import annotations

import ast
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

import mmkv
import mmkv.serve
from mmkv.prompt.blocks import LayoutBuilder
from mmkv.runtime.grammar import (
    DEFAULT_CACHE_BYTES,
    grammar_cache,
    json_schema,
    limits,
    set_cache_bytes,
    specs,
)
from mmkv.runtime.grammar import engine as grammar_engine
from mmkv.serve import Engine, ServerConfig
from mmkv.serve.app import create_app
from mmkv.serve.process import free_port
from mmkv.serve.worker import Worker
from tests.helpers import LIMITS, fresh, nested_any_of, strict_loads

MODEL = "tiny-qwen3-vl"
ROOT = Path(__file__).resolve().parents[2]
HANG = 120.0  # seconds after which a wait is a hang (never the property tested)
QUOTE, COMMA = 15, 25  # tiny-qwen3-vl's token ids of '"' and ','
CLICK = {"type": "function", "function": {"name": "click", "parameters": {"type": "object", "properties": {
    "target": {"enum": ["ok", "no"]}}, "required": ["target"]}}}  # fmt: skip
WAIT = {"type": "function", "function": {"name": "wait", "parameters": {"type": "object", "properties": {}}}}
OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def engine():
    """The server's engine: schemas up to 8 MB (so that the engine's own limits are what refuses them)."""
    engine = Engine(ServerConfig(model=MODEL, device="cpu", max_schema_bytes=8 << 20))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as client:
        yield client


@pytest.fixture(scope="module")
def hurried(engine):
    """A second app on the same model: a 3 s request deadline and the default schema bound (64 kB)."""
    other = Engine(ServerConfig(model=MODEL, device="cpu", request_timeout_s=3.0), handle=engine.handle)
    with TestClient(create_app(other)) as client:
        yield client
    other.close()


def ask(client: TestClient, **fields):
    """POST a chat completion: one user turn, 4 tokens unless ``fields`` say otherwise."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return client.post("/v1/chat/completions", json=body)


def plain_is_answered(client: TestClient) -> None:
    """A 4-token greedy request without a grammar is answered: 200, at most 4 tokens, ended."""
    reply = ask(client, temperature=0)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert 1 <= answer["usage"]["completion_tokens"] <= 4
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")


def grammar_fields(schema: dict, how: str) -> dict:
    """Request fields that make ``schema`` the answer's grammar: a response format, a tool's parameters under
    a required or a named choice (parallel calls allowed: the named choice ignores it), or a response format
    that a small tool's call may replace (tool_choice auto)."""
    form = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    if how == "response_format":
        return form
    if how == "auto with a format":
        return {**form, "tools": [CLICK], "tool_choice": "auto"}
    choice = "required" if how == "required" else {"type": "function", "function": {"name": "f"}}
    return {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
        "tool_choice": choice,
    }


# ---- 1. an engine limit is a 400 saying so, and changes nothing ----

SERVED_LIMITS = {
    **{name: schema for name, schema in LIMITS.items() if name != "deeply nested anyOf"},
    "a 1 MB const": {"type": "object", "properties": {"x": {"const": "ab" * 500_000}}, "required": ["x"]},
}


HOWS = ["response_format", "required", "named", "auto with a format"]


@pytest.mark.parametrize(
    "form, how",
    [
        (form, how)
        for form in SERVED_LIMITS
        for how in HOWS
        if (form, how) != ("a 1 MB const", "auto with a format")
    ],
)  # (that one below, streamed)
def test_a_schema_past_the_engines_limits_is_a_400_and_changes_nothing(client, form, how):
    """Recursion with no way out ($defs, the root, a two-definition loop), 5,000 and 800 optional properties, a
    1 MB const: as a response format, as a tool's parameters (required, named), and as a format a tool call may
    replace (auto), each is a 400 invalid request saying the schema "cannot be enforced", never a 500; a plain
    request after it is answered."""
    reply = ask(client, **grammar_fields(fresh(SERVED_LIMITS[form]), how))
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "cannot be enforced" in error["message"], error
    plain_is_answered(client)


@pytest.mark.parametrize("form", ["800 optional properties", "a 1 MB const"])
def test_a_limit_in_one_branch_is_refused_before_a_stream_starts(client, monkeypatch, form):
    """A format a tool call may replace (tool_choice auto) starts with a choice, so the engine meets a limit of
    the format's branch only once the answer enters it: it is still refused when compiled, a 400 before any
    stream starts (not a 200 stream that ends in an error event), with nothing queued for the model."""
    queued, submit = [], Worker.submit
    monkeypatch.setattr(
        Worker, "submit", lambda self, request: queued.append(request) or submit(self, request)
    )
    fields = grammar_fields(fresh(SERVED_LIMITS[form]), "auto with a format")
    reply = ask(client, stream=True, max_tokens=8, **fields)
    assert reply.status_code == 400, reply.text[:300]
    assert "cannot be enforced" in reply.json()["error"]["message"] and not queued
    plain_is_answered(client)


@pytest.mark.parametrize("how", HOWS)
def test_anyof_nested_past_the_bound_is_a_400(client, how):
    """anyOf nested past the depth bound is refused as the request's nesting (the body's bound, 64 levels,
    holds the schema's), a 400; anyOf nested as deep as the body allows is enforced (200)."""
    deep = {"type": "object", "properties": {"v": nested_any_of(40)}}
    reply = ask(client, **grammar_fields(deep, how))
    assert reply.status_code == 400 and "nested deeper than 64" in reply.json()["error"]["message"], (
        reply.text
    )
    shallow = {"type": "object", "properties": {"v": nested_any_of(27)}}  # 2 * 27 + 3 + the request's levels
    reply = ask(client, **grammar_fields(fresh(shallow), how))
    assert reply.status_code == 200, reply.text[:300]
    plain_is_answered(client)


# the assert statements of mmkv/serve and mmkv/runtime, each an internal invariant no request can break:
# (file, function) -> how many (a request reaching an assert would get a 500, or nothing at all under -O)
INVARIANT_ASSERTS = {
    ("mmkv/runtime/decode.py", "Decoder.pending"): 1,  # a token is pending while not finished
    ("mmkv/runtime/decode.py", "Decoder.advance"): 2,  # the engine's own call order
    ("mmkv/runtime/decode.py", "Decoder.answer"): 1,
    ("mmkv/runtime/grammar/engine.py", "Vocabulary.__post_init__"): 2,  # built by vocabulary() from a tokenizer
    ("mmkv/runtime/live.py", "LiveCache.mark_prompt"): 1,  # the cache and its bookkeeping agree
    ("mmkv/runtime/live.py", "LiveCache.append_tokens"): 1,
    ("mmkv/runtime/plan.py", "plan_turn"): 1,  # the kept prefix is the pool's, at a piece boundary
    ("mmkv/runtime/repair.py", "_attention_scores"): 1,  # a turn ends in computed text
    ("mmkv/runtime/repair.py", "_merge"): 1,
}  # fmt: skip


def test_no_assert_stands_on_a_path_a_request_can_reach():
    """The packages a request passes through (mmkv/serve, mmkv/runtime) hold no assert statements but the
    reviewed internal invariants above: none in the server, the grammar builders, the schema checks or the key
    guard, where input decides (a new one is a refusal to raise, or an invariant to add here)."""
    found: dict[tuple[str, str], int] = {}

    def walk(node: ast.AST, path: str, names: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (
                names + [child.name]
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                else names
            )
            if isinstance(child, ast.Assert):
                key = (path, ".".join(names))
                found[key] = found.get(key, 0) + 1
            walk(child, path, inner)

    for package in ("mmkv/serve", "mmkv/runtime"):
        for source in sorted((ROOT / package).rglob("*.py")):
            relative = source.relative_to(ROOT).as_posix()
            walk(ast.parse(source.read_text(), relative), relative, [])
    assert found == INVARIANT_ASSERTS
    assert not any(path.startswith("mmkv/serve/") for path, _ in found)


# ---- 2. grammar work runs off the event loop ----


@pytest.mark.parametrize("how", ["response_format", "required", "named", "auto with a format"])
def test_grammar_work_runs_off_the_event_loop(client, monkeypatch, how):
    """Checking a schema (check_schema), building and validating the grammar's text (json_rule, _validated)
    and compiling it (build_grammar) each run on a thread with no running event loop, for a response format,
    tools under required and named choices, and tools with a format under auto."""
    calls: list[tuple[str, bool]] = []  # (function, whether it ran on an event loop)

    def watched(module, name: str) -> None:
        original = getattr(module, name)

        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                calls.append((name, True))
            except RuntimeError:  # no running loop in this thread
                calls.append((name, False))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    watched(limits, "check_schema")
    watched(specs, "json_rule")
    watched(specs, "_validated")
    watched(grammar_engine, "build_grammar")
    fields = grammar_fields(fresh(OBJECT), how)
    reply = ask(client, max_tokens=1, **fields)
    assert reply.status_code == 200, reply.text
    assert {name for name, _ in calls} == {"check_schema", "json_rule", "_validated", "build_grammar"}
    assert not any(on_loop for _, on_loop in calls), calls


# ---- 3. the deadline and the one heavy turn ----


class WatchedTurn:
    """The heavy turn's semaphore, held by the test, saying when a request starts waiting for it."""

    def __init__(self, semaphore: threading.BoundedSemaphore) -> None:
        self.semaphore = semaphore
        self.waiting = threading.Event()  # a request asked for the turn

    def acquire(self, timeout: float = -1) -> bool:
        self.waiting.set()
        return self.semaphore.acquire(timeout=timeout)

    def release(self) -> None:
        self.semaphore.release()


@pytest.mark.parametrize("waits_at", ["its schema's checks", "its compile"])
def test_a_schema_waiting_for_the_turn_times_out_while_plain_requests_are_answered(
    hurried, monkeypatch, waits_at
):
    """With the heavy turn held (as another request's schema would hold it), a request whose schema must be
    checked, or whose checked schema must be compiled, waits for it until its deadline and gets a 504 saying
    it timed out waiting for its grammar; a plain request sent while it waits is answered (200) before that."""
    turn = WatchedTurn(limits._heavy)
    monkeypatch.setattr(limits, "_heavy", turn)
    schema = fresh(OBJECT)
    if waits_at == "its compile":
        json_schema(schema)  # checked and cached now: the request only needs the turn to compile
    assert turn.semaphore.acquire(timeout=HANG)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(ask, hurried, **grammar_fields(schema, "response_format"))
            assert turn.waiting.wait(HANG)
            plain_is_answered(hurried)
            assert not waiting.done()  # (its deadline is 3 s after it arrived)
            reply = waiting.result(HANG)
    finally:
        turn.semaphore.release()
    assert reply.status_code == 504, reply.text
    message = reply.json()["error"]["message"]
    assert "timed out" in message and "grammar" in message, message
    plain_is_answered(hurried)
    assert ask(hurried, **grammar_fields(schema, "response_format")).status_code == 200  # (the turn is free)


@pytest.mark.parametrize(
    "schema, words",
    [({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 3} for i in range(3000)}},
      "--max-schema-bytes"),
     ({"type": "object", "properties": {f"p{i}": {} for i in range(4100)}}, "more than 4,096 objects and arrays")],
)  # fmt: skip
@pytest.mark.parametrize("how", ["response_format", "required"])
def test_an_oversized_schema_is_a_400_before_any_model_work(hurried, monkeypatch, schema, words, how):
    """A schema past the request's byte bound (64 kB here), or past check_schema's node bound: a 400 saying
    which, with nothing compiled, laid out or queued for the model (and past the byte bound, not even
    checked)."""
    work = []
    for owner, name in ((limits, "check_schema"), (grammar_engine, "build_grammar"), (LayoutBuilder, "build"),
                        (Worker, "submit")):  # fmt: skip
        original = getattr(owner, name)
        monkeypatch.setattr(
            owner,
            name,
            lambda *a, _name=name, _original=original, **k: work.append(_name) or _original(*a, **k),
        )
    reply = ask(hurried, **grammar_fields(fresh(schema), how))
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text[:300]
    assert work == ([] if words.startswith("--") else ["check_schema"])


# ---- 4. the grammar cache's flag ----


@pytest.mark.parametrize("value", ["0", "-1"])
def test_the_grammar_cache_flag_refuses_a_bound_under_one_byte(value, capsys, monkeypatch):
    """``--grammar-cache-bytes`` 0 or negative: the config refuses it naming the setting, and ``mmkv serve``
    ends with that one line (exit 2) before the model loads."""
    from mmkv.cli import main

    with pytest.raises(ValueError, match=f"grammar_cache_bytes must be an int >= 1, got {value}"):
        ServerConfig(model=MODEL, grammar_cache_bytes=int(value))
    monkeypatch.setattr(mmkv.serve, "serve", lambda config: pytest.fail("the model would load"))
    status = main(["serve", "--model", MODEL, "--port", str(free_port()), "--grammar-cache-bytes", value])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.strip() == f"mmkv: serve: grammar_cache_bytes must be an int >= 1, got {value}"


def test_the_servers_bound_is_the_grammar_caches(engine):
    """A server made with ``grammar_cache_bytes`` bounds the process's grammar cache by it."""
    other = Engine(
        ServerConfig(model=MODEL, device="cpu", grammar_cache_bytes=32 << 20), handle=engine.handle
    )
    try:
        assert grammar_cache().max_bytes == 32 << 20
    finally:
        other.close()
        set_cache_bytes(DEFAULT_CACHE_BYTES)


# ---- 8. JSON answers are strict JSON ----

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
MAPS = [
    {"type": "object", "additionalProperties": DIGIT, "maxProperties": 4},
    {"type": "object", "properties": {"a": DIGIT}, "required": ["a"], "additionalProperties": {"type": "boolean"},
     "maxProperties": 3},
    {"type": "array", "items": {"type": "object", "additionalProperties": DIGIT, "maxProperties": 2}, "minItems": 2,
     "maxItems": 2},
    {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": DIGIT, "maxProperties": 2},
     "maxProperties": 2},
]  # fmt: skip


def keys_in(value) -> int:
    """How many keys the objects of a JSON value hold, at every depth."""
    if isinstance(value, dict):
        return len(value) + sum(map(keys_in, value.values()))
    return sum(map(keys_in, value)) if isinstance(value, list) else 0


def test_json_answers_parse_with_a_parser_that_refuses_repeated_keys(client):
    """Free maps (additionalProperties: a map, with declared properties, in arrays, nested) with logits pushed
    towards quotes and commas (the model tries the key "" again and again): every answer is content, never
    null, and parses with a duplicate-refusing parser and validates; so does a json_object answer."""
    bias = {str(QUOTE): 6, str(COMMA): 4}
    num_keys = 0
    for schema in MAPS:
        reply = ask(
            client, max_tokens=80, temperature=0, logit_bias=bias, **grammar_fields(schema, "response_format")
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and isinstance(choice["message"]["content"], str), choice
        value = strict_loads(choice["message"]["content"])
        jsonschema.validate(value, schema)
        num_keys += keys_in(value)
    assert num_keys >= 8  # (keys were written: the parser had something to refuse)
    reply = ask(client, max_tokens=40, temperature=0, response_format={"type": "json_object"})
    choice = reply.json()["choices"][0]
    assert reply.status_code == 200 and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" or isinstance(strict_loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize(
    "fields",
    [{"response_format": {"type": "json_object"}}, grammar_fields(OBJECT, "response_format"),
     {"tools": [CLICK], "tool_choice": "required"}, {"tools": [CLICK], "tool_choice": {"type": "function",
     "function": {"name": "click"}}}, {"tools": [CLICK], "tool_choice": "auto", "response_format": {"type": "json_object"}}],
)  # fmt: skip
def test_stop_sequences_are_refused_where_they_would_cut_a_grammars_answer(client, fields):
    """A stop sequence with a JSON response format (tools or not) or a required / named tool choice would cut
    the JSON or the call short (it was a 200 with content null, or '{', and finish_reason stop): refused by
    name, a 400 with param stop."""
    reply = ask(client, stop=["{"], **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "stop" and "stop" in reply.json()["error"]["message"]


def test_stop_sequences_are_honoured_in_free_text_with_tools(client):
    """Tools under auto without a format answer in free text: a stop sequence is honoured there (200)."""
    assert ask(client, stop=["{"], tools=[CLICK], tool_choice="auto").status_code == 200


# ---- 9. the same tools get the same verdict; one call means one call ----

BAD_TOOLS = {
    "a schema that is not one": [{"type": "function", "function": {"name": "f", "strict": True,
                                                                   "parameters": {"type": "nonsense"}}}],
    "parameters not an object": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
    "parameters not a schema": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
    "a bad name": [{"type": "function", "function": {"name": "bad name", "parameters": {"type": "object"}}}],
    "a name twice": [WAIT, WAIT],
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD_TOOLS))
def test_the_same_tools_get_the_same_400_whatever_the_choice(client, bad):
    """A tools list with an invalid entry (a schema that is not one, under strict; parameters not an object
    schema, not a schema at all; a bad name; a name twice) gets the same 400 error object under tool_choice
    auto, none, required and a named choice of a valid listed tool."""
    tools = [*BAD_TOOLS[bad], CLICK]
    errors = []
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "click"}}):
        reply = ask(client, tools=tools, tool_choice=choice)
        assert reply.status_code == 400, (choice, reply.text[:300])
        errors.append(reply.json()["error"])
    assert all(error == errors[0] for error in errors), errors


@pytest.mark.parametrize(
    "choice, parallel",
    [({"type": "function", "function": {"name": "wait"}}, True), ("required", False)],
)
def test_a_named_or_single_required_choice_answers_exactly_one_call(client, engine, choice, parallel):
    """A named choice (even with parallel calls on) is exactly one call of that function; required with
    parallel_tool_calls false is exactly one call; in both, a newline favoured (the separator of a second
    call) and room for several calls change nothing."""
    reply = ask(client, tools=[CLICK, WAIT], tool_choice=choice, parallel_tool_calls=parallel, temperature=0,
                max_tokens=200, logit_bias={str(engine.handle.tokenizer.encode("\n")[0]): 20})  # fmt: skip
    assert reply.status_code == 200, reply.text
    choice_out = reply.json()["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls", choice_out
    (call,) = choice_out["message"]["tool_calls"]
    if isinstance(choice, dict):
        assert call["function"]["name"] == "wait"
    assert reply.json()["usage"]["completion_tokens"] < 100  # (one call, then the end: room was left)


# ---- random schemas: never a 5xx, never a stall ----

names = st.sampled_from(["a", "b", "c", "d"])
leaves = st.one_of(
    st.fixed_dictionaries({"type": st.just("integer")},
                          optional={"minimum": st.integers(-5, 5), "maximum": st.integers(5, 500)}),
    st.fixed_dictionaries({"type": st.just("string")},
                          optional={"maxLength": st.integers(0, 4), "minLength": st.integers(0, 1)}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "number"}, {"const": "x"}, {"const": 3},
                     {"$ref": "#/$defs/node"}]),
    st.lists(st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b c", 'q"', None])), min_size=1, max_size=3,
             unique=True).map(lambda values: {"enum": values}),
)  # fmt: skip
bodies = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.builds(lambda properties, required, extra: {
            "type": "object", "properties": properties,
            "required": [name for name, is_required in zip(properties, required, strict=False) if is_required],
            **({} if extra == "unset" else {"additionalProperties": extra})},
            st.dictionaries(names, inner, max_size=3), st.lists(st.booleans(), max_size=3),
            st.sampled_from(["unset", False, True, {"type": "integer"}])),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        st.lists(inner, min_size=1, max_size=3).map(lambda alternatives: {"anyOf": alternatives}),
    ),
    max_leaves=8,
)  # fmt: skip
# the one definition bodies may name: a leaf, a recursive object with a way out, or one without (unsatisfiable)
definitions = st.sampled_from([
    {"type": "integer"},
    {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}},
    {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]},
    {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}]},
])  # fmt: skip
huge = st.sampled_from([
    {"type": "object", "properties": {"x": {"const": "ab" * 500_000}}, "required": ["x"]},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(800)}},
    {"type": "object", "properties": {f"p{i}": {} for i in range(5000)}},
    {"$ref": "#"},
])  # fmt: skip
# one schema in 16 huge; the others a body and the definition it may name
schemas = st.integers(0, 15).flatmap(
    lambda k: huge if k == 0 else st.builds(lambda body, node: {**body, "$defs": {"node": node}}, bodies, definitions)
)  # fmt: skip


def validated(schema: dict, tools: list[dict], reply: dict, how: str) -> None:
    """A 200's answer checked unless cut by its length: content that strictly parses and validates against the
    format's schema, or calls of listed tools (the named one) whose arguments validate against its parameters."""
    choice = reply["choices"][0]
    if choice["finish_reason"] == "length":
        return
    message = choice["message"]
    if message["tool_calls"]:
        assert how in ("required", "named", "auto"), message
        parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
        for call in message["tool_calls"]:
            name = call["function"]["name"]
            assert name == "f" or (how != "named" and name in parameters), name
            jsonschema.validate(strict_loads(call["function"]["arguments"]), parameters[name])
        return
    assert how in ("response_format", "auto") and isinstance(message["content"], str), (how, message)
    jsonschema.validate(strict_loads(message["content"]), schema)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    schema=schemas,
    how=st.sampled_from(["response_format", "required", "auto", "named"]),
    strict=st.booleans(),
)
def test_random_schemas_never_get_a_5xx_or_stall_the_server(client, schema, how, strict):
    """Random schemas (nested objects, arrays, enums, anyOf, $defs/$ref with and without a way out, now and
    then a huge const, thousands of properties or a $ref to the root) as a response format, or as a tool's
    parameters under required, named, and auto with the format: never a 5xx, a 200 or a 400; a 200's answer
    valid unless cut by its length (16 tokens for a format, 8 with tools: their prompts are long); and a
    4-token plain request answered after each."""
    parameters = {
        "type": "object",
        "properties": {"v": schema},
        "required": ["v"],
        "$defs": schema.get("$defs", {}),
    }
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": strict}},
        WAIT,
    ]
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}
    fields = {
        "response_format": {"response_format": form},
        "required": {"tools": tools, "tool_choice": "required"},
        "named": {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "auto": {"tools": tools, "tool_choice": "auto", "response_format": form},
    }[how]
    reply = ask(client, max_tokens=16 if how == "response_format" else 8, **fields)
    assert reply.status_code in (200, 400), reply.text[:500]
    if reply.status_code == 200:
        validated(schema, tools, reply.json(), how)
    else:
        assert reply.json()["error"]["message"]
    plain_is_answered(client)
