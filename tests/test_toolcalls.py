"""Hermes tool calls as text: the writer matches the chat templates, the reader finds calls and reports bad blocks."""

from __future__ import annotations

import json
import random

import pytest

import mmkv
from mmkv.toolcalls import (
    FunctionCall,
    MalformedToolCall,
    ParsedToolCalls,
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


def _random_calls(rng: random.Random) -> list[FunctionCall]:
    names = ["click", "type_text", "scroll-down"]
    return [
        FunctionCall(rng.choice(names), {f"k{i}": _random_value(rng, 1) for i in range(rng.randint(0, 3))})
        for _ in range(rng.randint(1, 3))
    ]


@pytest.mark.parametrize("model", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_format_matches_the_chat_template(model):
    """format_tool_calls writes exactly what the family's template renders for an assistant message of calls."""
    processor = mmkv.load(model, device="cpu").processor
    calls = [
        FunctionCall("click", {"target": "ok", "at": [1, 2]}),
        FunctionCall("type_text", {"text": 'né "x"'}),
    ]
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
    assert parsed.calls == (FunctionCall("a", {"x": 1}), FunctionCall("b", {}))
    assert parsed.content == "Sure.\ndone" and parsed.malformed == ()
    name, arguments = parsed.calls[0]
    assert (name, arguments) == ("a", {"x": 1}) and parsed.calls[0].arguments_json == '{"x": 1}'


def test_arguments_as_a_json_string_are_decoded():
    """Arguments written as a JSON string that holds an object are read as that object."""
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert parsed.calls == (FunctionCall("a", {"x": 2}),)


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
    assert parsed.calls == (FunctionCall("ok", {}),) and parsed.content == ""
    assert len(parsed.malformed) == 1 and parsed.malformed[0].text == bad
    assert reason in parsed.malformed[0].reason


def test_an_unclosed_block_is_reported():
    """A block cut off inside its JSON before </tool_call> (max_tokens) is malformed, not dropped silently."""
    parsed = parse_tool_calls('Hi <tool_call>\n{"name": "a", "arguments": {"x"')
    assert parsed.calls == () and parsed.content == "Hi"
    assert parsed.malformed == (
        MalformedToolCall('<tool_call>\n{"name": "a", "arguments": {"x"', "no closing </tool_call>"),
    )


def test_text_without_blocks_is_content():
    """Plain text parses to no calls and the text itself."""
    assert parse_tool_calls("  just words \n") == ParsedToolCalls((), "just words", ())


# ---------------------------------------------------------------------------------------------- ToolCallStream
from mmkv.toolcalls import ArgumentsPiece, CallStart, ContentPiece, ToolCallStream  # noqa: E402

STREAM_CASES = [
    ('<tool_call>\n{"name": "click", "arguments": {"target": "ok"}}\n</tool_call>', True),
    ('Sure.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
     '{"x": [1, {"y": "}\\n</tool"}]}}\n</tool_call>', True),
    ('Let me see. <tool_call>{"name":"c","arguments":"{\\"k\\": 2}"}</tool_call> then text', False),
    ("no calls at all, <tool and < signs", False),
    ('<tool_call>\nnot json\n</tool_call> after', False),
    ('text <tool_call>\n{"name": "cut", "arguments": {"a": ', False),
    ('<tool_call>\n{"name": "cut", "arguments": {"a": 1', True),
    ("</tool_call>", False),
    ('Done. </tool_call>\n', False),
    ('a</tool_call>b</tool_call></tool_call>', False),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n</tool_call>', False),
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n', False),
    ('I will. <tool_call>{"name": "a", "arguments": {}}', False),
]  # fmt: skip


def _assemble(pieces):
    content, calls = "", {}
    for piece in pieces:
        if isinstance(piece, ContentPiece):
            content += piece.text
        elif isinstance(piece, CallStart):
            calls[piece.index] = [piece.name, ""]
        else:
            calls[piece.index][1] += piece.text
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text,trusted", STREAM_CASES)
def test_a_streamed_answer_splits_as_the_whole_answer_does_at_any_cut(text, trusted):
    """Fed in random pieces (one character at a time, or many), the stream yields the same content and calls as
    the whole text fed at once; a call's name always comes before any of its arguments."""
    whole = ToolCallStream(trusted)
    expected = _assemble(whole.feed(text) + whole.finish())
    rng = random.Random(len(text))
    for _ in range(20):
        stream, pieces, cursor = ToolCallStream(trusted), [], 0
        while cursor < len(text):
            step = rng.randint(1, 6)
            pieces += stream.feed(text[cursor : cursor + step])
            cursor += step
        pieces += stream.finish()
        started = set()
        for piece in pieces:
            if isinstance(piece, CallStart):
                started.add(piece.index)
            if isinstance(piece, ArgumentsPiece):
                assert piece.index in started
        assert _assemble(pieces) == expected


def test_free_output_calls_are_read_and_malformed_blocks_stay_content():
    """In free output a well-formed block is a call (arguments as written, or as JSON when written as a string),
    and one that is not JSON goes out as content, tags and all."""
    stream = ToolCallStream(trusted=False)
    content, calls = _assemble(stream.feed(STREAM_CASES[2][0]) + stream.finish())
    assert calls == [("c", '{"k": 2}')] and content == "Let me see.\nthen text"
    stream = ToolCallStream(trusted=False)
    content, calls = _assemble(stream.feed(STREAM_CASES[4][0]) + stream.finish())
    assert calls == [] and content.startswith("<tool_call>") and "not json" in content


def test_trusted_calls_stream_their_arguments_as_written():
    """Grammar-made calls: the name goes out at once, arguments verbatim (nested braces and a string holding the
    closing tag's text included)."""
    stream = ToolCallStream(trusted=True)
    content, calls = _assemble(stream.feed(STREAM_CASES[1][0]) + stream.finish())
    assert content == "Sure." and calls == [("a", "{}"), ("b", '{"x": [1, {"y": "}\\n</tool"}]}')]
    assert json.loads(calls[1][1]) == {"x": [1, {"y": "}\n</tool"}]}


# (text, content, calls): what a free-output answer with unmatched tags comes to, streamed and whole
UNMATCHED = [
    ("</tool_call>", "", []),
    ("Done.</tool_call>", "Done.", []),
    ("Done. </tool_call>\n", "Done.", []),
    ("</tool_call></tool_call>", "", []),
    ("a </tool_call> b", "a\nb", []),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n</tool_call>', "", [("a", "{}")]),
    ('</tool_call> <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', "", [("a", '{"x": 1}')]),
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}', "", [("a", '{"x": 1}')]),
    ('I will. <tool_call>\n{"name": "a", "arguments": {}}\n\n', "I will.", [("a", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", UNMATCHED)
def test_unmatched_tags_in_free_output(text, content, calls):
    """A stray </tool_call> is dropped (the text around it is content) and an unclosed block at the end that
    reads as a call is one: the same for parse_tool_calls and for ToolCallStream, fed whole or a character at
    a time."""
    parsed = parse_tool_calls(text)
    assert parsed.content == content and parsed.malformed == ()
    assert [(c.name, c.arguments_json) for c in parsed.calls] == calls
    whole = ToolCallStream(trusted=False)
    assert _assemble(whole.feed(text) + whole.finish()) == (content, calls)
    stream = ToolCallStream(trusted=False)
    pieces = [p for ch in text for p in stream.feed(ch)] + stream.finish()
    assert _assemble(pieces) == (content, calls)


def test_an_unclosed_block_cut_inside_its_json_streams_as_content():
    """Cut by max_tokens inside the JSON, an unclosed block is no call: the stream gives it out as written."""
    stream = ToolCallStream(trusted=False)
    text = 'Hi <tool_call>\n{"name": "a", "arguments": {"x"'
    assert _assemble(stream.feed(text) + stream.finish()) == ("Hi" + text[3:], [])


def test_grammar_made_text_keeps_the_tags_characters():
    """Trusted (grammar-made) content is left as written: a JSON answer's string may hold '</tool_call>'."""
    stream = ToolCallStream(trusted=True)
    text = '{"note": "</tool_call>"}'
    assert _assemble(stream.feed(text) + stream.finish()) == (text, [])
