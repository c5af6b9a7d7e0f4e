"""``Conversation``: what a session says, as typed records: messages of text items (with named fields, or a
precompiled segment to splice) and image items pointing into its list of images.

Records are immutable; the conversation changes only through its methods, each of which either succeeds or
raises with nothing changed. Because messages are immutable, ``snapshot`` is a cheap copy of the message list
and ``restore`` puts a conversation back exactly (the rollback of a failed turn or edit). Example::

    conversation = Conversation()
    conversation.add_text("Policy. role: {role}.", "system", fields={"role": "admin"})
    conversation.add_image(image_record)          # a ConversationImage: pixels, digest, grid
    conversation.add_text("What now?")            # joins the user message holding the image
    [m.role for m in conversation.messages]       # ['system', 'user']
    conversation.set_field("role", "viewer")      # the system item now reads "Policy. role: viewer."

The conversation knows nothing about tokens or KV: ``mmkv.prompt`` renders it, ``mmkv.runtime`` caches it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from PIL import Image

from .cache.digest import ImageDigest
from .fields import fill_template, validate_fields

if TYPE_CHECKING:
    from .kv.segment import KVSegment

__all__ = [
    "ROLE_NAME",
    "check_role",
    "check_text",
    "Conversation",
    "ConversationImage",
    "ConversationState",
    "ImageItem",
    "Item",
    "Message",
    "TextItem",
]


ROLE_NAME = re.compile(
    r"[a-z][a-z_]{0,31}"
)  # "system", "user", "assistant", "tool", ...: no markup, no newlines


def check_text(text: object, name: str = "text") -> str:
    """``text`` if it is a ``str`` that encodes as UTF-8; else ``TypeError`` / ``ValueError`` naming ``name``
    (a lone surrogate such as ``"\\ud800"`` cannot be tokenised)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode: {exc.reason} at index {exc.start} ({text[exc.start]!r}); remove or "
            "replace that character"
        ) from None
    return text


def check_role(role: object) -> str:
    """``role`` if it is a role name the chat template can render safely (lowercase letters and ``_``, such as
    ``"system"``, ``"user"``, ``"assistant"``, ``"tool"``); else ``ValueError``."""
    if not isinstance(role, str) or not ROLE_NAME.fullmatch(role):
        raise ValueError(
            f"role must be a lowercase name such as 'user', 'assistant' or 'system', got {role!r}"
        )
    return role


@dataclass(frozen=True, eq=False)
class ConversationImage:
    """An image the conversation holds, normalised and keyed."""

    pixels: Image.Image  # normalised RGB (mmkv.images.load_image)
    digest: ImageDigest  # content key: pixels + processor settings + model fingerprint
    grid: tuple[int, int, int]  # vision grid (t, h, w) the processor gives it


@dataclass(frozen=True, eq=False)
class TextItem:
    """A piece of text in a message."""

    text: str  # the text as rendered (fields filled in)
    item_id: int  # unique in the conversation: the key of its token span in a traced rendering
    template: str | None = None  # the text with {name} placeholders, when it has fields
    fields: tuple[tuple[str, str], ...] = ()  # (name, value) of each field, in declaration order
    segment: KVSegment | None = None  # precompiled KV to splice for this text (add_segment), if any
    seam: int = 0  # with a segment: leading tokens recomputed in context

    def __post_init__(self) -> None:
        if self.fields and self.template is None:
            raise ValueError("a text item with fields needs its template")
        if self.seam < 0:
            raise ValueError(f"seam must be >= 0, got {self.seam}")

    @property
    def field_map(self) -> dict[str, str]:
        """The fields as a dict."""
        return dict(self.fields)


@dataclass(frozen=True, eq=False)
class ImageItem:
    """An image in a message."""

    image_index: int  # index into Conversation.images


Item = TextItem | ImageItem  # one entry of a message


@dataclass(frozen=True, eq=False)
class Message:
    """One chat message: a role and its items, in order."""

    role: str  # "system", "user", "assistant" (whatever the chat template takes)
    items: tuple[Item, ...]  # never empty in a Conversation (a prompt's window may hide all its images)

    @functools.cached_property
    def image_indices(self) -> tuple[int, ...]:
        """The conversation image index of each of its image items, in order."""
        return tuple(i.image_index for i in self.items if isinstance(i, ImageItem))

    @functools.cached_property
    def text_key(self) -> bytes:
        """A digest of what the message says apart from its pictures: its role, and in order each item's kind,
        text, field template and values, and precompiled segment (digest and seam). Two messages with the same
        key and the same images render to the same tokens (``mmkv.prompt.blocks`` keys blocks by it)."""
        digest = hashlib.blake2b(self.role.encode(), digest_size=16)
        for item in self.items:
            if isinstance(item, ImageItem):
                digest.update(b"\x00i")
                continue
            parts = [item.text, item.template or "", json.dumps(item.fields)]
            if item.segment is not None:
                parts += [item.segment.digest, str(item.seam)]
            for part in parts:
                raw = part.encode("utf-8", "surrogatepass")
                digest.update(b"\x00t" + len(raw).to_bytes(8, "little") + raw)
        return digest.digest()


@dataclass(frozen=True)
class ConversationState:
    """A snapshot of a conversation (``Conversation.snapshot``): enough to put it back exactly."""

    messages: tuple[Message, ...]
    num_images: int
    field_values: tuple[tuple[str, str], ...]
    next_item_id: int
    num_segments: int


class Conversation:
    """The messages and images of one session. Mutated only by its methods, each all-or-nothing."""

    def __init__(self) -> None:
        self.messages: list[Message] = []  # in order; never empty messages
        self.images: list[ConversationImage] = []  # in order of add_image
        self._field_values: dict[str, str] = {}  # current value of every field, by name
        self._next_item_id = 0
        self._num_segments = 0  # text items carrying a precompiled segment

    # ------------------------------------------------------------------------------------------- reading
    @property
    def field_values(self) -> Mapping[str, str]:
        """The current value of each named field (a read-only view)."""
        from types import MappingProxyType

        return MappingProxyType(self._field_values)

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
        self.images.append(image)
        self._append(role, ImageItem(len(self.images) - 1), new_message=new_message)
        return len(self.images) - 1

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

    def fork(self) -> Conversation:
        """A copy that shares only immutable records: later changes to one do not reach the other."""
        other = Conversation()
        other.images = list(self.images)
        other.messages = list(self.messages)
        other._field_values = dict(self._field_values)
        other._next_item_id = self._next_item_id
        other._num_segments = self._num_segments
        return other

    def clear(self) -> None:
        """Forget every message, image and field."""
        self.messages.clear()
        self.images.clear()
        self._field_values.clear()
        self._num_segments = 0

    def _append(self, role: str, item: Item, new_message: bool) -> None:
        check_role(role)
        if self.messages and self.messages[-1].role == role and not new_message:
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
