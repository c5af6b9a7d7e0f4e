"""Hermes tool calls as text: the writer matches the chat templates, the reader finds calls and reports bad blocks."""

from __future__ import annotations

import random

import pytest

import mmkv
from mmkv.runtime.toolcalls import (
    MalformedToolCall,
    ParsedToolCalls,
    ToolCall,
    format_tool_calls,
    parse_tool_calls,
)


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["int", "str", "bool", "null", "list", "dict"] if depth < 2 else ["int", "str", "bool"])
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "str":
        return "".join(rng.choice('ab "\\\n<>é漢') for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _random_calls(rng: random.Random) -> list[ToolCall]:
    names = ["click", "type_text", "scroll-down"]
    return [
        ToolCall(rng.choice(names), {f"k{i}": _random_value(rng, 1) for i in range(rng.randint(0, 3))})
        for _ in range(rng.randint(1, 3))
    ]


@pytest.mark.parametrize("model", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_format_matches_the_chat_template(model):
    """format_tool_calls writes exactly what the family's template renders for an assistant message of calls."""
    processor = mmkv.load(model, device="cpu").processor
    calls = [ToolCall("click", {"target": "ok", "at": [1, 2]}), ToolCall("type_text", {"text": 'né "x"'})]
    messages = [
        {"role": "user", "content": "Go."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ],
        },
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=False)
    assert "<|im_start|>assistant\n" + format_tool_calls(calls) + "<|im_end|>" in text


def test_round_trip_of_random_calls():
    """Parsing what format_tool_calls wrote gives the calls back, no content, nothing malformed (50 seeds)."""
    for seed in range(50):
        calls = _random_calls(random.Random(seed))
        assert parse_tool_calls(format_tool_calls(calls)) == ParsedToolCalls(tuple(calls), "", ())


def test_whitespace_and_surrounding_text_are_tolerated():
    """Whitespace around the JSON and text around the blocks are fine; the text comes back as content."""
    text = 'Sure.\n<tool_call>  {"name": "a", "arguments": {"x": 1}}  </tool_call>\n\n<tool_call>\n{"name":"b",\n"arguments":{}}\n</tool_call> done'
    parsed = parse_tool_calls(text)
    assert parsed.calls == (ToolCall("a", {"x": 1}), ToolCall("b", {}))
    assert parsed.content == "Sure.\ndone" and parsed.malformed == ()
    name, arguments = parsed.calls[0]
    assert (name, arguments) == ("a", {"x": 1}) and parsed.calls[0].arguments_json() == '{"x": 1}'


def test_arguments_as_a_json_string_are_decoded():
    """Arguments written as a JSON string that holds an object are read as that object."""
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert parsed.calls == (ToolCall("a", {"x": 2}),)


@pytest.mark.parametrize(
    "body, reason",
    [
        ("{not json}", "not JSON"),
        ("[1, 2]", "not an object"),
        ('{"arguments": {}}', "no 'name'"),
        ('{"name": "", "arguments": {}}', "no 'name'"),
        ('{"name": "a", "arguments": [1]}', "'arguments' is a JSON list"),
        ('{"name": "a", "arguments": "oops"}', "not JSON"),
    ],
)
def test_malformed_blocks_are_reported(body, reason):
    """A block that is not {"name": str, "arguments": object} is reported with its reason; good calls remain."""
    good = '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>'
    bad = f"<tool_call>\n{body}\n</tool_call>"
    parsed = parse_tool_calls(good + "\n" + bad)
    assert parsed.calls == (ToolCall("ok", {}),) and parsed.content == ""
    assert len(parsed.malformed) == 1 and parsed.malformed[0].text == bad
    assert reason in parsed.malformed[0].reason


def test_an_unclosed_block_is_reported():
    """A block cut off before </tool_call> (max_tokens) is malformed, not dropped silently."""
    parsed = parse_tool_calls('Hi <tool_call>\n{"name": "a", "arguments": {"x"')
    assert parsed.calls == () and parsed.content == "Hi"
    assert parsed.malformed == (
        MalformedToolCall('<tool_call>\n{"name": "a", "arguments": {"x"', "no closing </tool_call>"),
    )


def test_text_without_blocks_is_content():
    """Plain text parses to no calls and the text itself."""
    assert parse_tool_calls("  just words \n") == ParsedToolCalls((), "just words", ())
