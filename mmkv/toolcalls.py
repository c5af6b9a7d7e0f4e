"""Hermes tool calls as text: how the Qwen2.5-VL / Qwen3-VL chat templates write a call, and how an answer is read
back into calls. Knows nothing about tokens or grammars (``grammar.py`` constrains decoding to this format).

One call is ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``, ARGS the arguments as JSON with
``json.dumps``' default separators; several calls are joined by a newline, as the templates render an assistant
message's ``tool_calls``. Worked example::

    format_tool_calls([FunctionCall("click", {"target": "ok"})])
    '<tool_call>\\n{"name": "click", "arguments": {"target": "ok"}}\\n</tool_call>'

    parse_tool_calls('I will click.\\n<tool_call>\\n{"name": "click", "arguments": {}}\\n</tool_call>')
    ParsedToolCalls(calls=(FunctionCall(name='click', arguments={}),), content='I will click.', malformed=())

Parsing is lenient where a model's free output varies harmlessly (whitespace around the JSON, arguments given as
a JSON string holding an object) and reports every block it cannot read, with the reason, instead of raising:
a malformed call in an ``auto`` answer is model output, not a caller's mistake.

Unmatched tags in free output (``parse_tool_calls`` and ``ToolCallStream(trusted=False)`` alike, streamed or
whole):

- a stray ``</tool_call>`` (no block open) is dropped: it is the template's markup, never prose, and small or
  agent-tuned models end a turn with one after a tool result (pydantic-ai and openai-agents would otherwise
  finish their runs with ``'</tool_call>'`` as the final text). Text on either side stays content, set apart as
  around a block: ``'Done.</tool_call>'`` is content ``'Done.'``, ``'</tool_call>'`` alone no content at all;
- an unclosed ``<tool_call>`` at the end (the model ended its turn, or a stop string cut the closing tag) is a
  call when its body reads as one; otherwise (cut inside the JSON by ``max_tokens``) it is reported malformed
  ("no closing </tool_call>") and the stream gives it out as content, as written, so a cut answer stays visible.

vLLM's hermes parser reads an unclosed final block the same way, but returns a stray closing tag as content when
the answer has no opening one (and strips tags from text deltas only while streaming); here both paths agree.
Grammar-made text (``trusted``) is left as written: it holds no stray tags, and a JSON answer's strings may
contain the tag's characters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ArgumentsPiece",
    "CallStart",
    "ContentPiece",
    "MalformedToolCall",
    "ParsedToolCalls",
    "StreamPiece",
    "FunctionCall",
    "ToolCallStream",
    "format_tool_calls",
    "parse_tool_calls",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# a block runs from an opening tag to the next closing tag, or to the end of the text when it is never closed
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)


class FunctionCall(NamedTuple):
    """One function call: a name and its decoded arguments (unpacks as ``name, arguments``). Not the
    conversation's record of a call (``mmkv.messages.FunctionCall``, with its id and arguments as text)."""

    name: str  # the function's name, e.g. "click"
    arguments: dict[str, Any] = {}  # the decoded arguments object, e.g. {"target": "approve"}

    @property
    def arguments_json(self) -> str:
        """The arguments as the templates render them and the models write them (``json.dumps`` defaults,
        non-ASCII kept), for OpenAI's ``function.arguments`` string."""
        return json.dumps(self.arguments, ensure_ascii=False)

    def to_openai(self, call_id: str) -> dict:
        """The entry of an assistant message's ``tool_calls`` (``function.arguments`` a JSON string)."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }

    @classmethod
    def from_openai(cls, entry: dict) -> FunctionCall:
        """Back from a ``tool_calls`` entry (``arguments`` a JSON string or a mapping). Raises ``ValueError``
        when the arguments are not a JSON object."""
        function = entry.get("function", entry)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r}")
        return cls(str(function["name"]), arguments)

    def __str__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.arguments.items())})"


class MalformedToolCall(NamedTuple):
    """A ``<tool_call>`` block that does not hold a call."""

    text: str  # the whole block, tags included, as it appears in the answer
    reason: str  # what is wrong with it, e.g. "no closing </tool_call>"


@dataclass(frozen=True)
class ParsedToolCalls:
    """An answer split into its tool calls and the text around them."""

    calls: tuple[FunctionCall, ...]  # the well-formed calls, in order
    content: str  # the text outside the blocks (well-formed or not), stripped; "" when there is none
    malformed: tuple[MalformedToolCall, ...] = ()  # the blocks that could not be read, in order

    def __post_init__(self) -> None:
        assert all(isinstance(call, FunctionCall) for call in self.calls), self.calls


def format_tool_calls(calls: list[FunctionCall] | tuple[FunctionCall, ...]) -> str:
    """The text the chat templates render for an assistant message made only of ``calls`` (no content)."""
    return "\n".join(
        f'{TOOL_CALL_OPEN}\n{{"name": "{call.name}", "arguments": {call.arguments_json}}}\n{TOOL_CALL_CLOSE}'
        for call in calls
    )


def _read_block(body: str) -> FunctionCall | str:
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
    return FunctionCall(name, arguments)


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Every ``<tool_call>...</tool_call>`` block in ``text``, read as a call or reported as malformed (an
    unclosed one at the end is a call when its body reads as one; a stray ``</tool_call>`` is dropped: see the
    module docstring). Never raises; a text without blocks comes back as ``content`` alone. Does not check names
    or arguments against any tool list (the caller knows the tools)."""
    calls: list[FunctionCall] = []
    malformed: list[MalformedToolCall] = []
    outside: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        outside += text[end : match.start()].split(TOOL_CALL_CLOSE)  # a stray closing tag is dropped
        end = match.end()
        found = _read_block(match.group(1).strip())
        if isinstance(found, FunctionCall):  # closed, or unclosed at the end but whole
            calls.append(found)
        else:
            reason = found if match.group(2) else f"no closing {TOOL_CALL_CLOSE}"
            malformed.append(MalformedToolCall(match.group(0), reason))
    outside += text[end:].split(TOOL_CALL_CLOSE)
    content = "\n".join(part.strip() for part in outside if part.strip())
    return ParsedToolCalls(tuple(calls), content, tuple(malformed))


_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*'
)  # a block up to its arguments
_TAIL = "}\n" + TOOL_CALL_CLOSE  # what follows the arguments of a block written as the templates write it


@dataclass(frozen=True)
class ContentPiece:
    """Answer text outside tool calls."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its number in the answer and the function's name (arguments follow)."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """More of tool call ``index``'s arguments text."""

    index: int
    text: str


StreamPiece = ContentPiece | CallStart | ArgumentsPiece


class ToolCallStream:
    """An answer's text, fed as it is decoded, split into content and tool calls as OpenAI streams them: content
    outside the blocks, and per call first its name (``CallStart``), then its arguments text in pieces (as the
    model wrote it, without the wrapper). The same object serves a whole answer (``feed(text)`` then
    ``finish()``), so a streamed answer and a whole one agree by construction.

    ``trusted``: the text is known to be well-formed calls (a grammar made it): a call's name goes out as soon as
    it is written and its arguments as they come. Otherwise (``auto``: free output) each block is held until it
    closes, then read (``parse_tool_calls``' rules): a block that is not a call goes out as content, a stray
    ``</tool_call>`` is dropped, an unclosed block at the end is a call when whole (module docstring). Whitespace
    next to a block, and at the end, is not content.

    >>> stream = ToolCallStream(trusted=False)
    >>> stream.feed('Sure.\\n<tool_call>\\n{"name": "click", "arguments": {"target": "ok"}}\\n</tool_call>')
    [ContentPiece(text='Sure.'), CallStart(index=0, name='click'), ArgumentsPiece(index=0, text='{"target": "ok"}')]
    """

    def __init__(self, trusted: bool) -> None:
        self.trusted = trusted
        self._pending = ""  # text not yet emitted: a possible tag start, whitespace, an open block
        self._in_block = False
        self._head_done = False  # trusted: the current block's name went out
        self._after_block = False  # content resumes after a block: its leading whitespace is not content
        self._said = False  # some content went out (content after a block is then set off by a newline)
        self.num_calls = 0

    def feed(self, text: str) -> list[StreamPiece]:
        """Take more answer text; return what became certain."""
        self._pending += text
        out: list[StreamPiece] = []
        while True:
            if not self._in_block:
                at = self._pending.find(TOOL_CALL_OPEN)
                stray = -1 if self.trusted else self._pending.find(TOOL_CALL_CLOSE)
                if stray >= 0 and (at < 0 or stray < at):  # a closing tag with no block open: dropped
                    before = self._pending[:stray].rstrip()
                    if before.strip():
                        out.append(self._content(before))
                    self._pending, self._after_block = self._pending[stray + len(TOOL_CALL_CLOSE) :], True
                    continue
                if at < 0:
                    keep = _partial_suffix(self._pending, TOOL_CALL_OPEN)
                    if not self.trusted:
                        keep = max(keep, _partial_suffix(self._pending, TOOL_CALL_CLOSE))
                    body = self._pending[: len(self._pending) - keep]
                    sent = body.rstrip()  # trailing whitespace waits: it may precede a block
                    if sent.strip():
                        out.append(self._content(sent))
                        self._pending = self._pending[len(sent) :]
                    return out
                before = self._pending[:at].rstrip()
                if before.strip():
                    out.append(self._content(before))
                self._pending, self._in_block, self._head_done = (
                    self._pending[at + len(TOOL_CALL_OPEN) :],
                    True,
                    False,
                )
            if self.trusted:
                out += (
                    self._trusted_pieces()
                )  # leaves the closing tag first in _pending once the block closed
                closed = self._pending.find(TOOL_CALL_CLOSE) if self._head_done else -1
            else:
                closed = self._pending.find(TOOL_CALL_CLOSE)
                if closed >= 0:
                    out += self._read(self._pending[:closed])
            if closed < 0:
                return out
            self._pending, self._in_block = self._pending[closed + len(TOOL_CALL_CLOSE) :], False
            self._after_block = True

    def finish(self) -> list[StreamPiece]:
        """The answer ended: what is left (an unclosed block: its arguments so far when trusted; else a call when
        its body reads as one, content when not)."""
        out: list[StreamPiece] = []
        if (
            self._in_block and self.trusted and self._head_done
        ):  # cut short (the budget): its arguments so far
            pending = self._pending
            cut = next((k for k in range(len(_TAIL), 0, -1) if pending.endswith(_TAIL[:k])), 0)
            if pending[: len(pending) - cut]:
                out.append(ArgumentsPiece(self.num_calls - 1, pending[: len(pending) - cut]))
        elif self._in_block and not self.trusted:  # unclosed: a call when whole, else content as written
            if isinstance(_read_block(self._pending.strip()), FunctionCall):
                out += self._read(self._pending)
            else:
                out.append(self._content(TOOL_CALL_OPEN + self._pending.rstrip()))
        elif not self._in_block and self._pending.strip():
            out.append(self._content(self._pending.rstrip()))
        self._pending = ""
        return out

    def _content(self, text: str) -> ContentPiece:
        """``text`` as content: after a block, without its leading whitespace and set off by a newline."""
        if self._after_block:
            text = ("\n" if self._said else "") + text.lstrip()
            self._after_block = False
        self._said = True
        return ContentPiece(text)

    def _trusted_pieces(self) -> list[StreamPiece]:
        """A well-formed block: its name once its head is in, then arguments (the wrapper's end held back)."""
        out: list[StreamPiece] = []
        if not self._head_done:
            head = _HEAD.match(self._pending)
            if head is None or head.end() == len(self._pending):  # (more whitespace may still come)
                return out
            out.append(CallStart(self.num_calls, head.group(1)))
            self.num_calls += 1
            self._pending, self._head_done = self._pending[head.end() :], True
        closed = self._pending.find(TOOL_CALL_CLOSE)
        index = self.num_calls - 1
        if closed >= 0:
            arguments = self._pending[:closed].rstrip()
            arguments = arguments[:-1].rstrip() if arguments.endswith("}") else arguments
            if arguments:
                out.append(ArgumentsPiece(index, arguments))
            self._pending = self._pending[closed:]
            return out
        hold = len(_TAIL) + 2  # the block's end, "}\n</tool_call>", may be arriving
        if len(self._pending) > hold:
            out.append(ArgumentsPiece(index, self._pending[:-hold]))
            self._pending = self._pending[-hold:]
        return out

    def _read(self, body: str) -> list[StreamPiece]:
        """A whole free-output block: a call (its arguments as written, when written as the templates write
        them) or, when it is not one, content."""
        found = _read_block(body.strip())
        if not isinstance(found, FunctionCall):
            return [self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)]
        head = _HEAD.match(body)
        written = body[head.end() :].rstrip() if head else ""
        arguments = written[:-1].rstrip() if written.endswith("}") else found.arguments_json
        try:
            if json.loads(arguments) != found.arguments:
                arguments = found.arguments_json
        except json.JSONDecodeError:
            arguments = found.arguments_json
        self.num_calls += 1
        return [CallStart(self.num_calls - 1, found.name), ArgumentsPiece(self.num_calls - 1, arguments)]


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
