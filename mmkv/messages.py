"""The records a conversation is made of: text items (with named fields, or a precompiled segment to splice),
image items pointing into the conversation's images, tool calls, and messages. All immutable.

A message is one chat message, except for tool results: consecutive ``tool`` messages (the results of one
assistant turn's calls) are one ``Message`` with several ``responses``, because chat templates render them as
one unit (one user turn holding every ``<tool_response>``). Example, an assistant turn calling a tool and its
result holding a screenshot::

    Message("assistant", (), tool_calls=(ToolCall("call_1", "click", '{"target": "approve"}'),))
    Message("tool", (TextItem("clicked", 7), ImageItem(3)), responses=(("call_1", 2),))
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from PIL import Image

from .cache.digest import ImageDigest

if TYPE_CHECKING:
    from .kv.segment import KVSegment

__all__ = [
    "ROLE_NAME",
    "ConversationImage",
    "ImageItem",
    "Item",
    "Message",
    "TextItem",
    "ToolCall",
    "check_role",
    "check_text",
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
class ToolCall:
    """One function call an assistant message makes (OpenAI's ``tool_calls`` entry)."""

    id: str  # the call's id (tool results name it; templates do not render it)
    name: str  # the function's name
    arguments: str  # the arguments as JSON text, rendered verbatim (as the model wrote them)

    def __post_init__(self) -> None:
        for name in ("id", "name", "arguments"):
            check_text(getattr(self, name), f"tool call {name}")


@dataclass(frozen=True, eq=False)
class Message:
    """One chat message: a role and its items, in order (for ``tool``, the results of several calls)."""

    role: str  # "system", "user", "assistant", "tool" (whatever the chat template takes)
    items: tuple[Item, ...]  # never empty in a Conversation, except an assistant message making tool calls
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it makes, after its text
    responses: tuple[tuple[str, int], ...] = ()  # tool: (tool_call_id, items it holds) per result, in order

    def __post_init__(self) -> None:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages make tool calls")
        if self.role == "tool" and sum(n for _, n in self.responses) != len(self.items):
            raise ValueError("a tool message's responses must cover its items")
        if self.responses and self.role != "tool":
            raise ValueError("only tool messages hold tool responses")

    def showing(self, visible) -> Message:
        """This message without the images whose index is not in ``visible`` (a window hides them); a tool
        message's responses keep covering its items. ``self`` when nothing is hidden."""
        keep = [not isinstance(i, ImageItem) or i.image_index in visible for i in self.items]
        if all(keep):
            return self
        responses, cursor = [], 0
        for call_id, count in self.responses:
            responses.append((call_id, sum(keep[cursor : cursor + count])))
            cursor += count
        items = tuple(i for i, k in zip(self.items, keep, strict=True) if k)
        return replace(self, items=items, responses=tuple(responses))

    @functools.cached_property
    def image_indices(self) -> tuple[int, ...]:
        """The conversation image index of each of its image items, in order."""
        return tuple(i.image_index for i in self.items if isinstance(i, ImageItem))

    @functools.cached_property
    def text_key(self) -> bytes:
        """A digest of what the message says apart from its pictures: its role, its tool calls (names and
        arguments) and how its items split into tool responses, and in order each item's kind, text, field
        template and values, and precompiled segment (digest and seam). Two messages with the same
        key and the same images render to the same tokens (``mmkv.prompt.blocks`` keys blocks by it)."""
        digest = hashlib.blake2b(self.role.encode(), digest_size=16)
        for call in self.tool_calls:
            digest.update(b"\x00c" + json.dumps([call.name, call.arguments]).encode("utf-8", "surrogatepass"))
        digest.update(b"\x00r" + json.dumps([n for _, n in self.responses]).encode())
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
