"""Chat templates for the checkpoints mmkv builds itself (tiny random models, small trained models).

Real checkpoints bring their own template (``chat_template.jinja`` / ``chat_template.json``) and mmkv uses it
unchanged. These two follow the released families' image-message conventions:

- ``QWEN2_VL_TEMPLATE``: Qwen2-VL / Qwen2.5-VL style, a default system prompt when none is given;
- ``QWEN3_VL_TEMPLATE``: Qwen3-VL-Instruct style, no default system prompt (tool calls left out).

An image item in a message's content renders as ``<|vision_start|><|image_pad|><|vision_end|>``; the
processor then expands the single ``<|image_pad|>`` to one pad per language-model token.
"""

from __future__ import annotations

__all__ = ["QWEN2_VL_TEMPLATE", "QWEN3_VL_TEMPLATE"]

_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)

QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n" + _CONTENT + "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN3_VL_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n" + _CONTENT + "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
