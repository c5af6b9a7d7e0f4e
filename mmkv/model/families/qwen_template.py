"""The Qwen-VL chat template for the checkpoints mmkv builds itself (tiny random models, small trained models).

Real checkpoints bring their own template (``chat_template.jinja`` / ``chat_template.json``) and mmkv uses it
unchanged. These two follow the released families' conventions for images *and* tools, with the same tags:

- ``QWEN2_VL_TEMPLATE``: Qwen2-VL / Qwen2.5-VL style, a default system prompt when none is given;
- ``QWEN3_VL_TEMPLATE``: Qwen3-VL-Instruct style, no default system prompt.

Tools (``apply_chat_template(..., tools=[...])``, OpenAI function specs) are listed in the system message inside
``<tools></tools>``, one JSON object per line, with the hermes instruction the released templates use. An
assistant message's ``tool_calls`` render as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
(arguments given as a string are rendered verbatim, a mapping as JSON), and consecutive ``tool`` messages as
one user turn of ``<tool_response>\\n...\\n</tool_response>`` blocks, which may hold images. An image item
renders as ``<|vision_start|><|image_pad|><|vision_end|>``; the processor then expands the single
``<|image_pad|>`` to one pad per language-model token. Worked example (Qwen3-VL style)::

    [system "Act.", user [image, "Next?"], assistant tool_calls=[click(approve)], tool "done"]  tools=[click]
    <|im_start|>system\\nAct.\\n\\n# Tools\\n ... <tools>\\n{"type": "function", ...}\\n</tools> ... <|im_end|>
    <|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Next?<|im_end|>
    <|im_start|>assistant\\n<tool_call>\\n{"name": "click", "arguments": {"target": "approve"}}\\n</tool_call><|im_end|>
    <|im_start|>user\\n<tool_response>\\ndone\\n</tool_response><|im_end|>
"""

from __future__ import annotations

__all__ = ["QWEN2_VL_TEMPLATE", "QWEN3_VL_TEMPLATE", "TOOLS_INSTRUCTION"]

_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)

# The hermes tool instruction of the released Qwen2.5 / Qwen3(-VL) templates, word for word.
TOOLS_INSTRUCTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_END = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)


def _tools_system(default_system: str | None) -> str:
    """The system message that lists the tools (the first system message's content before them)."""
    lead = (
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set message = messages[0] %}"
        + _CONTENT
        + "{{ '\\n\\n' }}"
        + ("{% else %}" + default_system + "\n\n" if default_system else "")
        + "{% endif %}"
    )
    tools = "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    end = _TOOLS_END.replace('"', '\\"').replace("\n", "\\n")
    return (
        "<|im_start|>system\n" + lead + TOOLS_INSTRUCTION.replace("\n", "\\n").join(["{{ \"", "\" }}"])
        + tools + "{{ \"" + end + "\" }}<|im_end|>\n"
    )  # fmt: skip


_ASSISTANT = (
    "<|im_start|>assistant\n" + _CONTENT + "{% if message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% if (loop.first and message['content']) or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": '
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
)
_TOOL = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}" + _CONTENT + "{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
)


def _template(default_system: str | None) -> str:
    head = "{% if tools %}" + _tools_system(default_system)
    if default_system:
        head += (
            "{% elif not messages or messages[0]['role'] != 'system' %}"
            "<|im_start|>system\n" + default_system + "<|im_end|>\n"
        )
    head += "{% endif %}"
    loop = (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] == 'system' and tools %}"
        "{% elif message['role'] == 'assistant' %}" + _ASSISTANT
        + "{% elif message['role'] == 'tool' %}" + _TOOL
        + "{% else %}<|im_start|>{{ message['role'] }}\n" + _CONTENT + "<|im_end|>\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )  # fmt: skip
    return head + loop


QWEN2_VL_TEMPLATE = _template("You are a helpful assistant.")
QWEN3_VL_TEMPLATE = _template(None)
