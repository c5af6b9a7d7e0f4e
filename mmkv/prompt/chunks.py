"""A chat template's per-message chunks: what it renders for one message (as the first one or a later one), the
generation prompt it appends, and the probes that say how far mmkv may take the template apart.

Qwen-VL templates render ``<|im_start|>role\\n ... <|im_end|>\\n`` per message (Qwen2.5-VL adds a default system
message before a first message that is not one). Two properties are probed once per processor:

- **separable**: the rendering of a conversation is the concatenation of its messages' chunks plus the
  generation prompt (``is_separable``); only then are layouts built message by message;
- **verbatim**: every text is rendered exactly as given, whatever it holds (surrounding whitespace, newlines,
  braces, ``<think>`` tags, control-token strings, any script), in every role, tool-call names and arguments
  and tool results included (``is_verbatim``). Then a message's chunk is its *structure's* chunk (role, item
  kinds, tool calls, tool results, the declared tools' JSON shape; texts replaced by markers) with the texts put
  in, so chunks are cached per structure (``Templates.structure_chunk``) and a new message usually costs no
  template rendering at all; otherwise each message is also rendered with its texts to check.

Declared tools are rendered with the first message only (the Qwen templates list them in the system message at
the top); a tool message is the run of tool results between two other messages (``mmkv.messages``), which the
templates render as one unit.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict

from ..messages import ImageItem, Message
from .views import MARK, render_views, tool_views

__all__ = ["Templates", "is_separable", "is_verbatim", "templates_of"]

_ANCHOR = {"role": "user", "content": [{"type": "text", "text": "\ue002"}]}  # a stand-in first message
_STRUCTURES = 4096  # structure chunks kept per processor


class Templates:
    """Renders per-message chunks of one processor's chat template (anchor renderings and structure chunks
    cached). One per processor: ``templates_of``."""

    def __init__(self, processor) -> None:
        self.processor = processor
        render = processor.apply_chat_template
        self._anchor = render([_ANCHOR], add_generation_prompt=False)
        self.generation_suffix = render([_ANCHOR], add_generation_prompt=True)[len(self._anchor) :]
        self._structures: OrderedDict[tuple, str | None] = OrderedDict()
        self._lock = threading.Lock()  # sessions on several threads may share one processor

    def chunk(self, views: list[dict], first: bool, tools: list | None = None) -> str | None:
        """The text the template renders for one message's ``views`` (as the first message, with the declared
        ``tools``, or a later one), or None when the rendering of two messages does not start with that of the
        first alone."""
        render = self.processor.apply_chat_template
        if first:
            return render(views, add_generation_prompt=False, tools=tools)
        both = render([_ANCHOR, *views], add_generation_prompt=False)
        return both[len(self._anchor) :] if both.startswith(self._anchor) else None

    def structure_chunk(self, message: Message, first: bool, tools_json: str = "") -> str | None:
        """The marked chunk of ``message``'s structure (its role, the kinds of its items, its tool calls and tool
        results, and for a first message the declared tools' shape), rendered once."""
        views, _, items = render_views(message)
        tools = tool_views(tools_json, start=len(items))[0] if first and tools_json else None
        key = (
            message.role, first, tuple(isinstance(i, ImageItem) for i in message.items), len(message.tool_calls),
            tuple(n for _, n in message.responses), json.dumps(tools) if tools else "",
        )  # fmt: skip
        with self._lock:
            if key in self._structures:
                self._structures.move_to_end(key)
                return self._structures[key]
        chunk = self.chunk(views, first, tools)
        with self._lock:
            self._structures[key] = chunk
            if len(self._structures) > _STRUCTURES:
                self._structures.popitem(last=False)
        return chunk


_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # processor -> Templates
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # processor -> {"separable": bool, ...}
_LOCK = threading.RLock()


def templates_of(processor) -> Templates:
    """The processor's ``Templates`` (made once per processor and kept beside it, never on it)."""
    with _LOCK:
        templates = _TEMPLATES.get(processor)
        if templates is None:
            templates = _TEMPLATES[processor] = Templates(processor)
        return templates


def _probed(processor, name: str, probe) -> bool:
    """``probe(processor)``, worked out once per processor and kept beside it."""
    with _LOCK:
        facts = _PROBED.setdefault(processor, {})
        if name not in facts:
            facts[name] = probe(processor)
        return facts[name]


_PROBE = [
    {"role": "system", "content": [{"type": "text", "text": "\ue000s\ue001"}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\ue000u\ue001"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "\ue000a\ue001"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ue000v\ue001"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "\ue000b\ue001"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ue000w\ue001"}]},
]
_CALL = {"id": "c", "type": "function", "function": {"name": "\ue000n\ue001", "arguments": "\ue000g\ue001"}}
_TOOL_PROBE = [  # an agent's loop: tool calls (one, then two), their results (text, an image), a follow-up
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\ue000u\ue001"}]},
    {"role": "assistant", "content": [], "tool_calls": [_CALL]},
    {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "\ue000r\ue001"}]},
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "\ue000t\ue001"}],
        "tool_calls": [_CALL, _CALL],
    },
    {
        "role": "tool",
        "tool_call_id": "c",
        "content": [{"type": "text", "text": "\ue000p\ue001"}, {"type": "image"}],
    },
    {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "\ue000q\ue001"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ue000w\ue001"}]},
]
_TOOLS = [{"type": "function", "function": {"name": "\ue000f\ue001", "parameters": {"type": "object"}}}]
_AWKWARD_TEXTS = [  # what templates are known to rewrite: whitespace, think blocks, markup, cases, scripts
    "  leading and trailing spaces  ",
    "\nnewlines\n\nin between\n",
    "<think>\nreasoning\n</think>\n\nanswer",
    "{{ not a jinja expression }} {% raw %} {# #}",
    "<|im_end|>\n<|im_start|>system\n<|image_pad|><tool_call>{}</tool_call>",
    'UPPER lower Title\ttab {"json": "quotes\\n"}',
    "unicode: ñ ü 漢字 🙂 \u200b",
    "",
]


def _units(conversation: list[dict]) -> list[list[dict]]:
    """A conversation's messages as the units chunks are made of: consecutive tool results together."""
    units: list[list[dict]] = []
    for message in conversation:
        if message["role"] == "tool" and units and units[-1][-1]["role"] == "tool":
            units[-1].append(message)
        else:
            units.append([message])
    return units


def is_separable(processor) -> bool:
    """Whether ``processor``'s chat template renders every probe conversation (with and without declared tools,
    tool calls and tool results) as the concatenation of per-message chunks plus a generation suffix (probed
    once per processor)."""
    return _probed(processor, "separable", _probe_separable)


def _probe_separable(processor) -> bool:
    templates = templates_of(processor)
    probes = [(_PROBE, None), (_PROBE[1:], None), (_PROBE[2:], None), (_TOOL_PROBE, None), (_TOOL_PROBE, _TOOLS),
              (_PROBE, _TOOLS), (_PROBE[1:], _TOOLS)]  # fmt: skip
    for probe, tools in probes:
        units = _units(probe)
        chunks = [templates.chunk(unit, i == 0, tools if i == 0 else None) for i, unit in enumerate(units)]
        if any(c is None for c in chunks):
            return False
        for generation in (False, True):
            expected = processor.apply_chat_template(probe, add_generation_prompt=generation, tools=tools)
            if "".join(chunks) + (templates.generation_suffix if generation else "") != expected:
                return False
    return True


def is_verbatim(processor) -> bool:
    """Whether the chat template renders each of a set of awkward texts exactly as given, in every role, first
    or later, next to an image or not, as a tool call's name or arguments and as a tool result (probed once per
    processor)."""
    return _probed(processor, "verbatim", _probe_verbatim)


def _probe_verbatim(processor) -> bool:
    templates = templates_of(processor)
    mark = MARK.format(0)
    for text in _AWKWARD_TEXTS:
        cases = []
        for role in ("system", "user", "assistant", "tool"):
            for with_image in (False, True):
                items = [{"type": "image"}] if with_image and role in ("user", "tool") else []
                extra = {"tool_call_id": "c"} if role == "tool" else {}
                cases.append(({"role": role, "content": [*items, {"type": "text", "text": mark}], **extra},
                              {"role": role, "content": [*items, {"type": "text", "text": text}], **extra}))  # fmt: skip
        for field in ("name", "arguments"):

            def call(value, field=field):
                return [{**_CALL, "function": {**_CALL["function"], field: value}}]

            cases.append(({"role": "assistant", "content": [], "tool_calls": call(mark)},
                          {"role": "assistant", "content": [], "tool_calls": call(text)}))  # fmt: skip
        for marked, direct in cases:
            for first in (True, False):
                chunk = templates.chunk([marked], first)
                if chunk is None or chunk.replace(mark, text) != templates.chunk([direct], first):
                    return False
    return True
