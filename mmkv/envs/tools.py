"""The desktop's actions as OpenAI function tools; calls are ``mmkv.toolcalls.FunctionCall`` s (a name and a
mapping of arguments, serialised with ``json.dumps``' default separators: ``{"target": "approve"}``, the form the
small checkpoints are trained to emit, so a history an agent resends re-renders to the same text).
``hermes_text`` is exactly what the chat templates render for an assistant tool call
(``mmkv/model/templates.py``)::

    <tool_call>
    {"name": "click", "arguments": {"target": "approve"}}
    </tool_call>

``parse_tool_calls`` reads them back out of a model's answer (malformed blocks are skipped).
"""

from __future__ import annotations

import json

from ..toolcalls import FunctionCall, format_tool_calls
from ..toolcalls import parse_tool_calls as read_tool_calls

__all__ = ["TOOLS", "hermes_text", "parse_tool_calls", "tool_specs"]

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


def hermes_text(call: FunctionCall) -> str:
    """The assistant's tool call as the chat template renders it (no ``<|im_end|>``).

    >>> hermes_text(FunctionCall("click", {"target": "ok"}))
    '<tool_call>\\n{"name": "click", "arguments": {"target": "ok"}}\\n</tool_call>'
    """
    return format_tool_calls([call])


def parse_tool_calls(text: str) -> list[FunctionCall]:
    """Every well-formed hermes tool call in ``text``, in order (``mmkv.toolcalls.parse_tool_calls``' calls;
    anything else between the tags is skipped). Pure."""
    return list(read_tool_calls(text).calls)
