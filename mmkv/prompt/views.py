"""What the chat template is given: each message (and the declared tools) in two views, one with a private-use
marker in place of every piece of caller text, one with the text itself.

Rendering the marked view tells mmkv which characters of the prompt are the template's own (where its control
tokens are) and which are caller text (tokenised as text only, ``mmkv.prompt.render``); the direct view is what
the template would render, to check the two agree. Caller text is: text items, an assistant's tool-call names
and arguments (rendered verbatim by the Qwen templates), and every string of the declared tools' JSON (keys and
values; the text put back for its marker is the string as JSON writes it, escapes included, since the template
renders the tools with ``tojson``). Pieces that are not text items of the conversation become ``literal``
items (negative ``item_id``: never traced). Example, an assistant turn calling ``click``::

    marked  {"role": "assistant", "content": [], "tool_calls": [{"type": "function",
             "function": {"name": "\\ue0000\\ue001", "arguments": "\\ue0001\\ue001"}}]}
    direct  {... "function": {"name": "click", "arguments": "{\\"target\\": \\"approve\\"}"}}
    items   [literal("click"), literal('{"target": "approve"}')]
"""

from __future__ import annotations

import json

from ..messages import ImageItem, Message, TextItem

__all__ = ["MARK", "MARK_PATTERN", "is_literal", "render_views", "tool_views"]

MARK = "\ue000{}\ue001"  # stands in for caller text number {} while the template renders
MARK_PATTERN = r"\ue000([0-9]+)\ue001"
_LITERAL = -2  # literal items get item_id _LITERAL - number (the question is -1, conversation items >= 0)


def _literal(text: str, number: int) -> TextItem:
    return TextItem(text, _LITERAL - number)


def is_literal(item: TextItem) -> bool:
    """Whether ``item`` is caller text that is not a text item of the conversation (never traced)."""
    return item.item_id <= _LITERAL


def render_views(message: Message, start: int = 0) -> tuple[list[dict], list[dict], list[TextItem]]:
    """The template's two views of ``message`` (one template message, or one per tool result of a tool
    message), caller text numbered from ``start``; and the items the markers stand for, in order (its text items,
    then its tool calls' names and arguments). Changes nothing."""
    items: list[TextItem] = []

    def mark(item: TextItem) -> str:
        items.append(item)
        return MARK.format(start + len(items) - 1)

    def content(chosen) -> tuple[list[dict], list[dict]]:
        marked, direct = [], []
        for item in chosen:
            if isinstance(item, ImageItem):
                marked.append({"type": "image"})
                direct.append({"type": "image"})
            else:
                marked.append({"type": "text", "text": mark(item)})
                direct.append({"type": "text", "text": item.text})
        return marked, direct

    if message.role == "tool":
        marked_views, direct_views, cursor = [], [], 0
        for call_id, count in message.responses:
            marked, direct = content(message.items[cursor : cursor + count])
            cursor += count
            marked_views.append({"role": "tool", "tool_call_id": call_id, "content": marked})
            direct_views.append({"role": "tool", "tool_call_id": call_id, "content": direct})
        return marked_views, direct_views, items
    marked, direct = content(message.items)
    marked_view, direct_view = (
        {"role": message.role, "content": marked},
        {"role": message.role, "content": direct},
    )
    if message.tool_calls:
        marked_view["tool_calls"], direct_view["tool_calls"] = [], []
        for call in message.tool_calls:
            name = mark(_literal(call.name, start + len(items)))
            arguments = mark(_literal(call.arguments, start + len(items)))
            for view, (n, a) in (
                (marked_view, (name, arguments)),
                (direct_view, (call.name, call.arguments)),
            ):
                view["tool_calls"].append(
                    {"id": call.id, "type": "function", "function": {"name": n, "arguments": a}}
                )
    return [marked_view], [direct_view], items


def tool_views(tools_json: str, start: int = 0) -> tuple[list, list, list[TextItem]]:
    """The declared tools (JSON text) in the two views, every string (keys and values) a marker numbered from
    ``start`` in the marked one; and the literal items the markers stand for (each string as JSON writes it,
    without its quotes). Changes nothing."""
    direct = json.loads(tools_json)
    items: list[TextItem] = []

    def mark(value):
        if isinstance(value, str):
            items.append(_literal(json.dumps(value, ensure_ascii=False)[1:-1], start + len(items)))
            return MARK.format(start + len(items) - 1)
        if isinstance(value, list):
            return [mark(v) for v in value]
        if isinstance(value, dict):
            return {mark(k): mark(v) for k, v in value.items()}
        return value

    return mark(direct), direct, items
