"""The agents' API of a real ``mmkv serve`` (tiny-qwen3-vl, random weights) through the official ``openai``
client: tool calls (required, named, auto), structured output, logprobs, tool loops with screenshots in tool
results, and refusals. Random weights decide nothing, so what is asserted is what constrained decoding and the
protocol guarantee whatever the weights."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
import torch

import mmkv
from mmkv.runtime import grammar
from tests.helpers import random_object, random_tools

from .conftest import data_url, png, user

pytestmark = pytest.mark.server

MODEL = "tiny-qwen3-vl"
CLICK = {"type": "function", "function": {"name": "click", "description": "Click a button.", "parameters": {
    "type": "object", "properties": {"target": {"type": "string", "enum": ["approve", "submit"]}},
    "required": ["target"]}}}  # fmt: skip


def _satisfiable(make):
    """Draw ``make()`` until the grammar engine can enforce it (a random schema may be unsatisfiable, e.g. a
    required string with minLength 1 and maxLength 0: the server refuses those with a 400, tested below)."""
    while True:
        value = make()
        try:
            if isinstance(value, list):
                grammar.tool_calls(value, "required")
            else:
                grammar.json_schema(value, True)
            return value
        except mmkv.GrammarError:
            continue


def _validate(tools: list[dict], call) -> dict:
    """The call's arguments, checked: a listed name, JSON that validates against that tool's parameters."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    assert call.function.name in schemas, call.function.name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return arguments


def test_required_and_named_tool_choice_always_call_a_listed_tool(server):
    """Twelve random tool lists (nested objects, enums, arrays, required fields): with tool_choice "required"
    the answer is a call of a listed tool and with a named choice a call of that tool, arguments valid against
    its schema, finish_reason "tool_calls", no content."""
    client, rng = server.client(), random.Random(22)
    for _ in range(12):
        tools = _satisfiable(lambda: random_tools(rng))
        named = rng.choice(tools)["function"]["name"]
        for choice in ("required", {"type": "function", "function": {"name": named}}):
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Act."}], tools=tools, tool_choice=choice,
                parallel_tool_calls=False, max_tokens=600, temperature=0,
            )  # fmt: skip
            choice_out = reply.choices[0]
            assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None
            (call,) = choice_out.message.tool_calls
            _validate(tools, call)
            if isinstance(choice, dict):
                assert call.function.name == named


def test_json_schema_output_validates(server):
    """Twelve random JSON schemas as response_format (strict and not): the content parses and validates (the
    hypothesis test in test_grammar_limits.py sends many more shapes)."""
    client, rng = server.client(), random.Random(5)
    for k in range(12):
        schema = _satisfiable(lambda: random_object(rng))
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=600, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": k % 2 == 0}},
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=300,
                                           temperature=0, response_format={"type": "json_object"})  # fmt: skip
    assert (
        isinstance(json.loads(reply.choices[0].message.content), dict)
        or reply.choices[0].finish_reason == "length"
    )


def _streamed(client, **request) -> tuple[str | None, list[tuple[str, str]], str]:
    """A streamed answer joined: content, (name, arguments) per call from the deltas, finish reason."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        if delta.content:
            content = (content or "") + delta.content
        for piece in delta.tool_calls or ():
            if piece.id is not None:  # the first delta of a call: index, id and name
                assert piece.index not in calls and piece.function.name
                calls[piece.index] = [piece.function.name, piece.function.arguments or ""]
            else:
                calls[piece.index][1] += piece.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "options",
    [{"tools": [CLICK], "tool_choice": "required"}, {"tools": [CLICK], "tool_choice": "auto"},
     {"tools": [CLICK], "tool_choice": "required", "parallel_tool_calls": True},
     {"response_format": {"type": "json_object"}}, {}],
)  # fmt: skip
def test_stream_and_non_stream_agree_tool_call_deltas_included(server, options):
    """The same greedy request streamed and not: the same content, the same calls (names and arguments
    assembled from the deltas), the same finish reason."""
    client = server.client()
    request = {"model": MODEL, "messages": [user("Step 1: here is the screen.")], "max_tokens": 200,
               "temperature": 0, **options}  # fmt: skip
    whole = client.chat.completions.create(**request).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert _streamed(client, **request) == (whole.message.content, calls, whole.finish_reason)


def test_a_tool_loop_with_screenshots_reuses_the_pool_and_the_store(server):
    """An agent loop: screenshot, tool call, a tool result holding the next screenshot, a follow-up; then the
    window slides and the result's screenshot comes back at another position: every request 200, the pool
    continues the conversation (cached tokens), and the moved screenshot's KV is spliced from the store."""
    client = server.client()
    first, second = data_url(31), data_url(32)
    messages = [{"role": "system", "content": "You operate a desktop app."},
                user({"type": "image_url", "image_url": {"url": first}}, "Do the task.")]  # fmt: skip
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[CLICK], tool_choice="required",
                                           max_tokens=120, temperature=0)  # fmt: skip
    call = reply.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": [
                     {"type": "text", "text": "clicked"}, {"type": "image_url", "image_url": {"url": second}}]}]  # fmt: skip
    follow = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CLICK], max_tokens=8, temperature=0
    )
    extra = follow.model_extra["mmkv"]
    assert follow.usage.prompt_tokens_details.cached_tokens > 0
    assert [i["source"] for i in extra["images"]] == ["live", "computed"]
    moved = [messages[0], user("The screen again:", {"type": "image_url", "image_url": {"url": second}})]
    again = client.chat.completions.create(model=MODEL, messages=moved, max_tokens=4, temperature=0)
    assert [i["source"] for i in again.model_extra["mmkv"]["images"]] == ["memory"]


def test_logprobs_are_the_models_own_and_sorted(server):
    """logprobs / top_logprobs: one entry per generated token with its bytes, the top ones sorted, each equal to
    what Session.ask reports for the same conversation on the same model (which the decode tests check against a
    full forward of the model), streamed and not."""
    client = server.client()
    messages = [user({"type": "image_url", "image_url": {"url": data_url(41)}}, "Describe it.")]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3)  # fmt: skip
    entries = reply.choices[0].logprobs.content
    session = mmkv.Session(mmkv.load(MODEL, device="cpu"), reuse="none")
    session.add_image(png(41))
    answer = session.ask("Describe it.", max_new_tokens=6, logprobs=3)
    expected = [
        e for e in answer.logprobs if e.token_id != mmkv.runtime.decode.end_of_turn_id(session.handle)
    ]
    assert len(entries) == len(expected) >= 1
    for got, want in zip(entries, expected, strict=True):
        assert abs(got.logprob - want.logprob) <= 1e-4 and got.bytes == list(want.bytes)
        assert [t.logprob for t in got.top_logprobs] == sorted(
            (t.logprob for t in got.top_logprobs), reverse=True
        )
        assert len(got.top_logprobs) == 3
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True):  # fmt: skip
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == [
        (e.token, round(e.logprob, 6)) for e in entries
    ]
    assert torch.tensor([e.logprob for e in entries]).le(0).all()


@pytest.mark.parametrize(
    "extra, status, param",
    [({"foo_bar": 1}, 400, "foo_bar"), ({"n": 2}, 400, "n"), ({"reasoning_effort": "high"}, 400, "reasoning_effort"),
     ({"store": True}, 400, "store"), ({"top_logprobs": 3}, 400, "top_logprobs"),
     ({"messages": [{"role": "user", "content": "hi", "cache_control": {}}]}, 400, "messages.0.user.cache_control"),
     ({"tool_choice": "required"}, 400, "tool_choice"),
     ({"tools": [CLICK], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, None),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
       "properties": {"a": {"type": "string", "not": {"const": "b"}}}}, "strict": True}}}, 400, None)],
)  # fmt: skip
def test_what_is_not_honoured_is_refused_by_name(server, extra, status, param):
    """An unknown field (OpenAI's own message), n > 1, documented fields this server does not do, top_logprobs
    without logprobs, an unknown field inside a message, a tool choice without tools, a named tool not listed, a
    strict schema the grammar cannot enforce: each a 400 error object naming what to change; never a 200."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = server.post(body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    if "foo_bar" in extra:
        assert error["message"] == "Unrecognized request argument supplied: foo_bar"


def test_unknown_routes_methods_and_the_responses_api_are_error_objects(server):
    """An unknown route 404, a wrong method 405, /v1/responses a 404 saying it is not served: OpenAI error
    objects all; the openai client raises its NotFoundError for the Responses API."""
    for method, path, status in (("GET", "/v1/nope", 404), ("DELETE", "/v1/chat/completions", 405),
                                 ("POST", "/v1/responses", 404), ("GET", "/v2/chat/completions", 404)):  # fmt: skip
        response = httpx.request(method, f"{server.base_url}{path}", json={}, timeout=30)
        assert response.status_code == status and set(response.json()["error"]) >= {"message", "type"}
    with pytest.raises(openai.NotFoundError, match="Responses API"):
        server.client().responses.create(model=MODEL, input="hi")
