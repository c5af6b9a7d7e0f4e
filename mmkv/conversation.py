"""``Conversation``: what a session says, as typed records (``mmkv.messages``): messages of text items (with
named fields, or a precompiled segment to splice) and image items pointing into its list of images; assistant
tool calls and tool results; and the tools the prompt declares.

Records are immutable; the conversation changes only through its methods, each of which either succeeds or
raises with nothing changed. Because messages are immutable, ``snapshot`` is a cheap copy of the message list
and ``restore`` puts a conversation back exactly (the rollback of a failed turn or edit). Example::

    conversation = Conversation()
    conversation.add_text("Policy. role: {role}.", "system", fields={"role": "admin"})
    conversation.add_image(image_record)          # a ConversationImage: pixels, digest, grid
    conversation.add_text("What now?")            # joins the user message holding the image
    [m.role for m in conversation.messages]       # ['system', 'user']
    conversation.set_field("role", "viewer")      # the system item now reads "Policy. role: viewer."
    conversation.set_tools([{"type": "function", "function": {"name": "click", "parameters": {...}}}])
    conversation.add_tool_calls([ToolCall("call_1", "click", '{"target": "approve"}')])
    conversation.add_tool_response("call_1")      # then add_text / add_image with role="tool"

The conversation knows nothing about tokens or KV: ``mmkv.prompt`` renders it, ``mmkv.runtime`` caches it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from .fields import fill_template, validate_fields
from .messages import (
    ConversationImage,
    ImageItem,
    Item,
    Message,
    TextItem,
    ToolCall,
    check_role,
    check_text,
)
from .toolcalls import ArgumentsPiece, CallStart, ToolCallStream

if TYPE_CHECKING:
    from .kv.segment import KVSegment

__all__ = ["Conversation", "ConversationState"]


@dataclass(frozen=True)
class ConversationState:
    """A snapshot of a conversation (``Conversation.snapshot``): enough to put it back exactly."""

    messages: tuple[Message, ...]
    num_images: int
    field_values: tuple[tuple[str, str], ...]
    next_item_id: int
    num_segments: int
    tools_json: str


class Conversation:
    """The messages and images of one session. Mutated only by its methods, each all-or-nothing."""

    def __init__(self) -> None:
        self.messages: list[Message] = []  # in order; never empty messages
        self.images: list[ConversationImage] = []  # in order of add_image
        self._field_values: dict[str, str] = {}  # current value of every field, by name
        self._next_item_id = 0
        self._num_segments = 0  # text items carrying a precompiled segment
        self.tools_json = ""  # the tools the prompt declares, as JSON text ("" for none; set_tools)

    # ------------------------------------------------------------------------------------------- reading
    @property
    def field_values(self) -> Mapping[str, str]:
        """The current value of each named field (a read-only view)."""
        return MappingProxyType(self._field_values)

    @property
    def tools(self) -> list[dict] | None:
        """The tools the prompt declares (OpenAI function specs; a fresh copy), or None."""
        return json.loads(self.tools_json) if self.tools_json else None

    @property
    def uses_tools(self) -> bool:
        """Whether the prompt declares tools or holds a tool call or a tool result."""
        return bool(self.tools_json) or any(m.role == "tool" or m.tool_calls for m in self.messages)

    def field_item(self, name: str) -> tuple[int, int, TextItem]:
        """``(message index, item index, item)`` of the text item holding field ``name``; ``KeyError`` naming the
        known fields when there is none."""
        if name in self._field_values:
            for m, message in enumerate(self.messages):
                for i, item in enumerate(message.items):
                    if isinstance(item, TextItem) and any(n == name for n, _ in item.fields):
                        return m, i, item
        raise KeyError(f"no field {name!r} in this session; fields: {sorted(self._field_values)}")

    def visible_images(self, window: int | None) -> range:
        """Indices of the images a prompt shows: the last ``window`` (all when ``None``)."""
        first = 0 if window is None else max(0, len(self.images) - window)
        return range(first, len(self.images))

    def prompt_messages(self, history_start: int = 0) -> list[Message]:
        """The messages a prompt shows when the turns before message ``history_start`` have been dropped: every
        pinned message (system messages, and messages holding fields or a precompiled segment) and every
        message from ``history_start`` on, in order."""
        if history_start <= 0:
            return list(self.messages)
        return [m for i, m in enumerate(self.messages) if i >= history_start or _is_pinned(m)]

    def next_turn_start(self, history_start: int) -> int | None:
        """The index of the first user message after message ``history_start`` that is not pinned (where the
        history may start once the oldest turn is dropped), or None when no turn is left to drop."""
        for i in range(max(history_start, 0) + 1, len(self.messages)):
            if self.messages[i].role == "user" and not _is_pinned(self.messages[i]):
                return i
        return None

    def has_segments(self) -> bool:
        """Whether any text item carries a precompiled segment."""
        return self._num_segments > 0

    def to_chat(self) -> list[dict]:
        """The messages as plain dicts (a fresh copy): text items ``{"type": "text", "text", "item_id"}`` (plus
        ``"template"`` and ``"fields"`` when it has fields), image items ``{"type": "image", "image_index"}``."""
        out = []
        for message in self.messages:
            content = []
            for item in message.items:
                if isinstance(item, ImageItem):
                    content.append({"type": "image", "image_index": item.image_index})
                    continue
                entry = {"type": "text", "text": item.text, "item_id": item.item_id}
                if item.fields:
                    entry |= {"template": item.template, "fields": item.field_map}
                content.append(entry)
            out.append({"role": message.role, "content": content})
        return out

    # ------------------------------------------------------------------------------------------- changing
    def add_text(
        self,
        text: str,
        role: str = "user",
        fields: Mapping[str, str] | None = None,
        *,
        new_message: bool = False,
        segment: KVSegment | None = None,
        seam: int = 0,
    ) -> TextItem:
        """Append ``text`` as ``role`` (joined to the last message when it has that role, unless
        ``new_message``). ``fields`` names editable values (``{name}`` once each in ``text``, names unique in the
        conversation). Returns the new item. Raises ``TypeError`` / ``ValueError`` with nothing changed."""
        check_text(text)
        check_role(role)
        checked = validate_fields(text, fields or {})
        for name, value in checked.items():
            check_text(value, f"field {name!r}")
        taken = sorted(set(checked) & set(self._field_values))
        if taken:
            raise ValueError(f"field {taken[0]!r} already exists in this session; field names must be unique")
        filled = fill_template(text, checked)[0]
        item = TextItem(
            filled,
            self._next_item_id,
            template=text if checked else None,
            fields=tuple(checked.items()),
            segment=segment,
            seam=seam,
        )
        self._append(role, item, new_message)
        self._next_item_id += 1
        self._num_segments += segment is not None
        self._field_values.update(checked)
        return item

    def add_image(self, image: ConversationImage, role: str = "user", *, new_message: bool = False) -> int:
        """Append ``image`` to the last ``role`` message (a new one if the last message has another role, or
        with ``new_message``). Returns its index in ``images``."""
        if not isinstance(image, ConversationImage):
            raise TypeError(f"add_image takes a ConversationImage, got {type(image).__name__}")
        check_role(role)
        self._append(role, ImageItem(len(self.images)), new_message=new_message)  # raises before any change
        self.images.append(image)
        return len(self.images) - 1

    def set_tools(self, tools: Sequence[Mapping] | None) -> None:
        """Declare ``tools`` (OpenAI function specs, ``{"type": "function", "function": {"name": ...,
        "description": ..., "parameters": {...}}}``) to the model: the chat template lists them in the system
        message. ``None`` or empty: none. Raises ``TypeError`` / ``ValueError`` with nothing changed."""
        if not tools:
            self.tools_json = ""
            return
        if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
            raise TypeError(f"tools must be a list of function specs, got {type(tools).__name__}")
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
                raise ValueError(
                    f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
                )
            check_text(function.get("name"), f"tools[{index}].function.name")
        try:
            text = json.dumps(list(tools), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tools must be plain JSON: {exc}") from None
        check_text(text, "tools")
        self.tools_json = text

    def add_tool_calls(self, calls: Sequence[ToolCall], text: str = "") -> None:
        """Append an assistant message making ``calls`` (after ``text``, if any). Raises ``TypeError`` /
        ``ValueError`` with nothing changed."""
        if not calls or not all(isinstance(call, ToolCall) for call in calls):
            raise TypeError("add_tool_calls takes a non-empty list of ToolCall")
        check_text(text)
        items = (TextItem(text, self._next_item_id),) if text else ()
        self.messages.append(Message("assistant", items, tool_calls=tuple(calls)))
        self._next_item_id += bool(items)

    def add_tool_response(self, tool_call_id: str) -> None:
        """Begin the result of call ``tool_call_id``: ``add_text`` / ``add_image`` with ``role="tool"`` then add
        to it. Results following one another share one tool message (templates render them as one turn)."""
        check_text(tool_call_id, "tool_call_id")
        if self.messages and self.messages[-1].role == "tool":
            last = self.messages[-1]
            self.messages[-1] = replace(last, responses=(*last.responses, (tool_call_id, 0)))
        else:
            self.messages.append(Message("tool", (), responses=((tool_call_id, 0),)))

    def add_tool_result(self, tool_call_id: str, text: str, images: Sequence[ConversationImage] = ()) -> None:
        """Append the result of call ``tool_call_id``: ``text`` then ``images``; all or nothing."""
        state = self.snapshot()
        try:
            self.add_tool_response(tool_call_id)
            if text or not images:
                self.add_text(text, "tool")
            for image in images:
                self.add_image(image, "tool")
        except BaseException:
            self.restore(state)
            raise

    def add_answer(self, text: str, trusted: bool = False) -> tuple[ToolCall, ...]:
        """Append an assistant answer: with tools declared, one made of ``<tool_call>`` blocks as the calls it
        makes (ids new, arguments as written; ``trusted``: a grammar wrote them, see ``ToolCallStream``), which
        come back; otherwise (or when a block is not a call) as text."""
        calls: dict[int, list[str]] = {}
        content: list[str] = []
        if self.tools_json:
            stream = ToolCallStream(trusted)
            for piece in stream.feed(text) + stream.finish():
                if isinstance(piece, CallStart):
                    calls[piece.index] = [piece.name, ""]
                elif isinstance(piece, ArgumentsPiece):
                    calls[piece.index][1] += piece.text
                else:
                    content.append(piece.text)
        if not calls:
            self.add_text(text, "assistant")
            return ()
        made = tuple(
            ToolCall(f"call_{uuid.uuid4().hex[:24]}", n, a) for n, a in (calls[i] for i in sorted(calls))
        )
        self.add_tool_calls(made, "".join(content))
        return made

    def set_field(self, name: str, value: str) -> None:
        """Give field ``name`` the new ``value`` (its item's text re-filled). ``KeyError`` for an unknown field,
        ``TypeError`` / ``ValueError`` for a bad value; nothing changes then."""
        m, i, item = self.field_item(name)
        check_text(value, f"field {name!r}")
        fields = validate_fields(item.template, {**item.field_map, name: value})
        new_item = replace(item, text=fill_template(item.template, fields)[0], fields=tuple(fields.items()))
        message = self.messages[m]
        self.messages[m] = replace(message, items=message.items[:i] + (new_item,) + message.items[i + 1 :])
        self._field_values[name] = value

    def note_field_value(self, name: str, value: str) -> None:
        """Record that field ``name`` now holds ``value`` without changing the text that declared it (an
        erratum later in the conversation announced the change). ``KeyError`` for an unknown field."""
        self.field_item(name)
        self._field_values[name] = value

    def snapshot(self) -> ConversationState:
        """The conversation as it is now (O(messages) references; records are immutable)."""
        return ConversationState(
            tuple(self.messages),
            len(self.images),
            tuple(self._field_values.items()),
            self._next_item_id,
            self._num_segments,
            self.tools_json,
        )

    def restore(self, state: ConversationState) -> None:
        """Put the conversation back to ``state`` (taken from this conversation, images added since dropped)."""
        if state.num_images > len(self.images):
            raise ValueError("restore: the snapshot holds images this conversation no longer has")
        self.messages[:] = state.messages
        del self.images[state.num_images :]
        self._field_values = dict(state.field_values)
        self._next_item_id = state.next_item_id
        self._num_segments = state.num_segments
        self.tools_json = state.tools_json

    def fork(self) -> Conversation:
        """A copy that shares only immutable records: later changes to one do not reach the other."""
        other = Conversation()
        other.images = list(self.images)
        other.messages = list(self.messages)
        other._field_values = dict(self._field_values)
        other._next_item_id = self._next_item_id
        other._num_segments = self._num_segments
        other.tools_json = self.tools_json
        return other

    def clear(self) -> None:
        """Forget every message, image and field."""
        self.messages.clear()
        self.images.clear()
        self._field_values.clear()
        self._num_segments = 0
        self.tools_json = ""

    def _append(self, role: str, item: Item, new_message: bool) -> None:
        check_role(role)
        if role == "tool":  # an item of the tool result begun last
            if not self.messages or self.messages[-1].role != "tool":
                raise ValueError("a tool result needs add_tool_response(tool_call_id) first")
            last = self.messages[-1]
            (call, count), earlier = last.responses[-1], last.responses[:-1]
            self.messages[-1] = replace(
                last, items=(*last.items, item), responses=(*earlier, (call, count + 1))
            )
        elif (
            self.messages
            and self.messages[-1].role == role
            and not new_message
            and not self.messages[-1].tool_calls
        ):
            last = self.messages[-1]
            self.messages[-1] = replace(last, items=(*last.items, item))
        else:
            self.messages.append(Message(role, (item,)))


def _is_pinned(message: Message) -> bool:
    """Whether dropping old turns must keep ``message``: system text, fields, precompiled segments."""
    return message.role == "system" or any(
        isinstance(i, TextItem) and (i.fields or i.segment is not None) for i in message.items
    )


def grids_tensor(images: list[ConversationImage], order: list[int]) -> torch.Tensor:
    """``(N, 3)`` long: the vision grids of ``images[i]`` for ``i`` in ``order``."""
    return torch.tensor([images[i].grid for i in order], dtype=torch.long).reshape(-1, 3)
