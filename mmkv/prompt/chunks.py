"""A chat template's per-message chunks: what it renders for one message (as the first one or a later one), the
generation prompt it appends, and the probe that says whether it renders a conversation message by message.

Qwen-VL templates render ``<|im_start|>role\n ... <|im_end|>\n`` per message (Qwen2.5-VL adds a default system
message before a first message that is not one): the rendering of a conversation is then the concatenation of
its messages' chunks plus the generation prompt, which ``is_separable`` checks on probe conversations once per
processor. ``mmkv.prompt.blocks`` builds layouts from chunks only when it holds.
"""

from __future__ import annotations

from ..conversation import Message, TextItem
from .render import _MARK

__all__ = ["Templates", "is_separable", "render_views"]

_ANCHOR = {"role": "user", "content": [{"type": "text", "text": "\ue002"}]}  # a stand-in first message


def render_views(message: Message) -> tuple[dict, dict, list[TextItem]]:
    """The template's view of ``message``: with markers for its text items, and with the texts themselves."""
    marked, direct, items = [], [], []
    for item in message.items:
        if isinstance(item, TextItem):
            marked.append({"type": "text", "text": _MARK.format(len(items))})
            direct.append({"type": "text", "text": item.text})
            items.append(item)
        else:
            marked.append({"type": "image"})
            direct.append({"type": "image"})
    return {"role": message.role, "content": marked}, {"role": message.role, "content": direct}, items


class Templates:
    """Renders per-message chunks of one processor's chat template (the anchor renderings cached)."""

    def __init__(self, processor) -> None:
        self.processor = processor
        render = processor.apply_chat_template
        self._anchor = render([_ANCHOR], add_generation_prompt=False)
        self.generation_suffix = render([_ANCHOR], add_generation_prompt=True)[len(self._anchor) :]

    def chunk(self, message: dict, first: bool) -> str | None:
        """The text the template renders for ``message`` (as the first message or a later one), or None when
        the rendering of two messages does not start with that of the first alone."""
        render = self.processor.apply_chat_template
        if first:
            return render([message], add_generation_prompt=False)
        both = render([_ANCHOR, message], add_generation_prompt=False)
        return both[len(self._anchor) :] if both.startswith(self._anchor) else None


_PROBE = [
    {"role": "system", "content": [{"type": "text", "text": "\ue000s\ue001"}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\ue000u\ue001"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "\ue000a\ue001"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ue000v\ue001"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "\ue000b\ue001"}]},
    {"role": "user", "content": [{"type": "text", "text": "\ue000w\ue001"}]},
]


def is_separable(processor) -> bool:
    """Whether ``processor``'s chat template renders every probe conversation as the concatenation of
    per-message chunks plus a generation suffix (cached on the processor)."""
    cached = getattr(processor, "_mmkv_separable", None)
    if cached is None:
        templates = Templates(processor)
        cached = True
        for probe in (_PROBE, _PROBE[1:], _PROBE[2:]):
            for generation in (False, True):
                chunks = [templates.chunk(m, i == 0) for i, m in enumerate(probe)]
                if any(c is None for c in chunks):
                    cached = False
                    break
                expected = processor.apply_chat_template(probe, add_generation_prompt=generation)
                joined = "".join(chunks) + (templates.generation_suffix if generation else "")
                cached = cached and joined == expected
        processor._mmkv_separable = cached
    return cached
