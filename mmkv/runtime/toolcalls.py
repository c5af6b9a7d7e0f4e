"""Hermes tool calls as text: how the Qwen2.5-VL / Qwen3-VL chat templates write a call, and how an answer is read
back into calls. Knows nothing about tokens or grammars (``grammar.py`` constrains decoding to this format).

One call is ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``, ARGS the arguments as JSON with
``json.dumps``' default separators; several calls are joined by a newline, as the templates render an assistant
message's ``tool_calls``. Worked example::

    format_tool_calls([ToolCall("click", {"target": "ok"})])
    '<tool_call>\\n{"name": "click", "arguments": {"target": "ok"}}\\n</tool_call>'

    parse_tool_calls('I will click.\\n<tool_call>\\n{"name": "click", "arguments": {}}\\n</tool_call>')
    ParsedToolCalls(calls=(ToolCall(name='click', arguments={}),), content='I will click.', malformed=())

Parsing is lenient where a model's free output varies harmlessly (whitespace around the JSON, arguments given as
a JSON string holding an object) and reports every block it cannot read, with the reason, instead of raising:
a malformed call in an ``auto`` answer is model output, not a caller's mistake.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "MalformedToolCall",
    "ParsedToolCalls",
    "ToolCall",
    "format_tool_calls",
    "parse_tool_calls",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# a block runs from an opening tag to the next closing tag, or to the end of the text when it is never closed
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)


class ToolCall(NamedTuple):
    """One function call, as the model wrote it (unpacks as ``name, arguments``)."""

    name: str  # the function's name
    arguments: dict[str, Any]  # the decoded arguments object

    def arguments_json(self) -> str:
        """The arguments as the templates render them (``json.dumps`` defaults, non-ASCII kept), for OpenAI's
        ``function.arguments`` string."""
        return json.dumps(self.arguments, ensure_ascii=False)


class MalformedToolCall(NamedTuple):
    """A ``<tool_call>`` block that does not hold a call."""

    text: str  # the whole block, tags included, as it appears in the answer
    reason: str  # what is wrong with it, e.g. "no closing </tool_call>"


@dataclass(frozen=True)
class ParsedToolCalls:
    """An answer split into its tool calls and the text around them."""

    calls: tuple[ToolCall, ...]  # the well-formed calls, in order
    content: str  # the text outside the blocks (well-formed or not), stripped; "" when there is none
    malformed: tuple[MalformedToolCall, ...] = ()  # the blocks that could not be read, in order

    def __post_init__(self) -> None:
        assert all(isinstance(call, ToolCall) for call in self.calls), self.calls


def format_tool_calls(calls: list[ToolCall] | tuple[ToolCall, ...]) -> str:
    """The text the chat templates render for an assistant message made only of ``calls`` (no content)."""
    return "\n".join(
        f'{TOOL_CALL_OPEN}\n{{"name": "{call.name}", "arguments": {call.arguments_json()}}}\n{TOOL_CALL_CLOSE}'
        for call in calls
    )


def _read_block(body: str) -> ToolCall | str:
    """The call in one block's body, or the reason there is none."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at character {e.pos})"
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object with 'name' and 'arguments'"
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return "no 'name' string"
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"'arguments' is a JSON {type(arguments).__name__}, not an object"
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Every ``<tool_call>...</tool_call>`` block in ``text``, read as a call or reported as malformed. Never
    raises; a text without blocks comes back as ``content`` alone. Does not check names or arguments against
    any tool list (the caller knows the tools)."""
    calls: list[ToolCall] = []
    malformed: list[MalformedToolCall] = []
    outside: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        outside.append(text[end : match.start()])
        end = match.end()
        if not match.group(2):
            malformed.append(MalformedToolCall(match.group(0), f"no closing {TOOL_CALL_CLOSE}"))
            continue
        found = _read_block(match.group(1).strip())
        if isinstance(found, ToolCall):
            calls.append(found)
        else:
            malformed.append(MalformedToolCall(match.group(0), found))
    outside.append(text[end:])
    content = "\n".join(part.strip() for part in outside if part.strip())
    return ParsedToolCalls(tuple(calls), content, tuple(malformed))
