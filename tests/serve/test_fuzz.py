"""No input produces a 500: property-based requests (hypothesis) over the chat-completions schema, valid and
not, against a real server; and the forms an adversarial run turned into 500s before (deep JSON, numeric edges
of sampling, seeds past 64 bits, streamed or not)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import data_url

pytestmark = pytest.mark.server

MODEL = "tiny-qwen3-vl"

numbers = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-38, 1e-300, 0.0, -0.0])
)  # fmt: skip
texts = st.one_of(st.text(max_size=40), st.sampled_from(["<|im_start|>", "<tool_call>", "\x00", "{}"]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(texts, inner, max_size=4)), max_leaves=12)  # fmt: skip
image_parts = st.builds(lambda url, detail: {"type": "image_url", "image_url": {"url": url, "detail": detail}},
                        st.one_of(st.just(data_url(3)), st.sampled_from(["data:image/png;base64,AAAA", "file:///etc/passwd",
                                  "http://127.0.0.1/x.png", "gopher://x", ""])), st.sampled_from(["auto", "low", "high", "max"]))  # fmt: skip
parts = st.lists(
    st.one_of(st.builds(lambda t: {"type": "text", "text": t}, texts), image_parts, json_values), max_size=3
)
contents = st.one_of(texts, parts, st.none(), numbers)
tool_specs = st.lists(st.one_of(
    st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
              st.sampled_from(["click", "fill", "bad name", ""]),
              st.one_of(st.just({"type": "object", "properties": {"t": {"type": "string", "maxLength": 3}}}), json_values)),
    json_values), max_size=3)  # fmt: skip
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]), "content": contents},
    optional={"tool_call_id": texts, "name": texts,
              "tool_calls": st.lists(st.fixed_dictionaries({"id": texts, "type": st.just("function"),
                                     "function": st.fixed_dictionaries({"name": texts, "arguments": texts})}), max_size=2)}),
    min_size=0, max_size=4)  # fmt: skip
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, "gpt-4", ""]), "messages": messages},
    optional={
        "max_tokens": st.one_of(st.integers(-2, 3), numbers), "temperature": numbers, "top_p": numbers, "seed": numbers,
        "stop": st.one_of(texts, st.lists(texts, max_size=5), numbers), "stream": st.booleans(), "n": numbers,
        "logprobs": st.one_of(st.booleans(), numbers), "top_logprobs": numbers, "frequency_penalty": numbers,
        "presence_penalty": numbers, "logit_bias": st.dictionaries(texts, numbers, max_size=3), "tools": tool_specs,
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), json_values),
        "parallel_tool_calls": scalars, "response_format": st.one_of(
            st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}]), json_values),
        "top_k": numbers, "repetition_penalty": numbers, "mmkv": json_values, "foo_bar": json_values,
        "stream_options": json_values, "user": texts,
    },
)  # fmt: skip


def _no_server_error(server, body: dict) -> int:
    """Post ``body`` (as JSON, NaN and Infinity included as Python writes them); return the status after
    checking it is not 5xx and, for a stream, that no event is a server error."""
    response = server.post(
        json.dumps(body, allow_nan=True).encode(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code < 500, (body, response.text[:500])
    if response.status_code == 200 and body.get("stream") is True:
        assert '"server_error"' not in response.text, response.text[-500:]
    return response.status_code


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_no_request_gets_a_5xx(server, body):
    """Whatever the fields hold (wrong types, NaN and infinities, huge and tiny numbers, hostile text, unknown
    fields, bad tools and formats), the answer is a 2xx or a 4xx with an error object, never a 5xx."""
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3
    body.setdefault("max_tokens", 2)
    _no_server_error(server, body)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "extra",
    [{"temperature": 1e-38}, {"temperature": 5e-324, "seed": 1}, {"temperature": 1.0, "top_p": 1e-300},
     {"temperature": 1.0, "top_p": 5e-324, "seed": 3}, {"temperature": 2.0, "seed": 2**64 - 1},
     {"temperature": 1.0, "seed": -(2**63)}, {"seed": 2**64}, {"seed": -(2**63) - 1},
     {"temperature": 1.0, "top_k": 1}, {"logit_bias": {"5": 100}, "temperature": 0.5, "seed": 9}],
)  # fmt: skip
def test_sampling_edges_answer_or_refuse_never_fail(server, extra, stream):
    """The numeric edges that used to be 500s: tiny temperatures and top_p sample the most likely token, seeds
    at the ends of 64 bits are used, seeds past them are a 400 before any stream starts."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": stream,
        **extra,
    }
    status = _no_server_error(server, body)
    outside = "seed" in extra and not -(2**63) <= extra["seed"] < 2**64
    assert status == (400 if outside else 200)


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    """JSON nested past 64 levels (1000, 100000 deep: a RecursionError to a plain parser) is refused as a 400."""
    head = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})[:-1]
    body = head + ', "mmkv": ' + "[" * depth + "]" * depth + "}"
    response = server.post(body.encode())
    assert response.status_code == 400 and "nested" in response.json()["error"]["message"]


def _parsed_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_parsed_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_parsed_depth, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from([None, 0, 2]), st.booleans())
def test_the_depth_check_counts_what_the_parser_nests(value, indent, ascii_only):
    """The body's nesting is counted without parsing (brackets inside strings, escaped quotes and backslashes
    skipped), and equals the depth the JSON parser builds, for any JSON value and any spacing or escaping."""
    from mmkv.serve.app import _depth

    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert _depth(text.encode("utf-8", "surrogatepass")) == _parsed_depth(json.loads(text))
