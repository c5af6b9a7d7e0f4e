"""The desktop's actions as OpenAI function tools, and tool calls as records, hermes text and OpenAI messages.

A ``ToolCall`` is a name and a mapping of arguments. Its arguments are serialised with ``json.dumps`` and the
default separators (``{"target": "approve"}``), the form the small checkpoints are trained to emit, so that a
history an agent resends re-renders to the same text. ``hermes_text`` is exactly what the chat templates render
for an assistant tool call (``mmkv/model/templates.py``)::

    <tool_call>
    {"name": "click", "arguments": {"target": "approve"}}
    </tool_call>

``parse_tool_calls`` reads them back out of a model's answer (malformed blocks are skipped).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOLS", "ToolCall", "hermes_text", "parse_tool_calls", "tool_specs"]

CLICK_TARGETS = ("approve", "submit", "ok", "close")
FIELDS = ("note",)
ITEMS = ("ticket",)


def _tool(name: str, description: str, properties: dict[str, dict]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS: tuple[dict, ...] = (  # short: the chat template renders this block into every prompt
    _tool("click", "Click a button.", {"target": {"type": "string", "enum": list(CLICK_TARGETS)}}),
    _tool(
        "fill",
        "Type text into a field.",
        {"field": {"type": "string", "enum": list(FIELDS)}, "text": {"type": "string"}},
    ),
    _tool("escalate", "Escalate the open item.", {"item": {"type": "string", "enum": list(ITEMS)}}),
)


def tool_specs() -> list[dict]:
    """A fresh copy of ``TOOLS`` (callers may change it freely)."""
    return json.loads(json.dumps(TOOLS))


@dataclass(frozen=True)
class ToolCall:
    """One function call."""

    name: str  # the tool's name, e.g. "click"
    arguments: dict[str, Any] = field(default_factory=dict)  # e.g. {"target": "approve"}

    @property
    def arguments_json(self) -> str:
        """The arguments as the model emits them: ``json.dumps`` with the default separators."""
        return json.dumps(self.arguments)

    def to_openai(self, call_id: str) -> dict:
        """The entry of an assistant message's ``tool_calls`` (``function.arguments`` a JSON string)."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }

    @classmethod
    def from_openai(cls, entry: dict) -> ToolCall:
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
        inner = ", ".join(f"{k}={v}" for k, v in self.arguments.items())
        return f"{self.name}({inner})"


def hermes_text(call: ToolCall) -> str:
    """The assistant's tool call as the chat template renders it (no ``<|im_end|>``).

    >>> hermes_text(ToolCall("click", {"target": "ok"}))
    '<tool_call>\\n{"name": "click", "arguments": {"target": "ok"}}\\n</tool_call>'
    """
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments_json}}}\n</tool_call>'


_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every well-formed hermes tool call in ``text``, in order: a JSON object with a string ``name`` and an
    object ``arguments``; anything else between the tags is skipped. Pure."""
    calls = []
    for block in _BLOCK.findall(text):
        try:
            body = json.loads(block)
        except json.JSONDecodeError:
            continue
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            arguments = body.get("arguments", {})
            if isinstance(arguments, dict):
                calls.append(ToolCall(body["name"], arguments))
    return calls
