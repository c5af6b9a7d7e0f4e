"""agent_messages: the OpenAI message list an agent resends, a window of screenshots, both placements; the chat
template renders it with the hermes tags, and a resent history re-renders the same text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmkv.envs import (
    SCREEN_TEXT,
    FunctionCall,
    agent_messages,
    expert_episode,
    hermes_text,
    image_data_url,
    keep_last_screenshots,
    message_images,
    parse_tool_calls,
    tool_result_messages,
)
from mmkv.synthetic import picture_digest


@pytest.fixture(scope="module")
def episode():
    e = expert_episode(2)
    assert len(e.steps) >= 5
    return e


def _text(message) -> str:
    content = message["content"]
    return content if isinstance(content, str) else content[0]["text"]


def _image_parts(messages):
    return [
        p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] != "text"
    ]


def test_the_message_list_has_the_agent_loop_shape(episode):
    """system, user (task + screenshot), then per step an assistant tool call and its tool result; ids pair
    up; arguments are a JSON string with the default separators."""
    messages = episode.messages(3)
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3
    assert messages[0]["content"] == episode.system and _text(messages[1]) == episode.task
    assert isinstance(
        messages[1]["content"], str
    )  # 4 screenshots so far, the window keeps 3: the first is dropped
    for k in range(3):
        call, result = messages[2 + 2 * k], messages[3 + 2 * k]
        (entry,) = call["tool_calls"]
        assert entry["id"] == result["tool_call_id"] == f"call_{k}" and entry["type"] == "function"
        assert entry["function"]["arguments"] == json.dumps(episode.steps[k].call.arguments)
        assert FunctionCall.from_openai(entry) == episode.steps[k].call
        assert (
            result["content"] if isinstance(result["content"], str) else result["content"][0]["text"]
        ) == (episode.steps[k].result)


@pytest.mark.parametrize("screenshot_in", ["tool", "user"])
@pytest.mark.parametrize("window", [1, 3, None])
def test_only_the_last_screenshots_keep_their_images(episode, screenshot_in, window):
    """Exactly the last ``window`` screenshots are image parts, in order; dropped ones leave their text."""
    k = len(episode.steps)
    messages = episode.messages(k, screenshot_in=screenshot_in, window=window)
    shots = [episode.first_image, *(s.image for s in episode.steps)]
    kept = shots if window is None else shots[-window:]
    assert [picture_digest(i) for i in message_images(messages)] == [picture_digest(i) for i in kept]
    assert len(_image_parts(messages)) == len(kept)
    if screenshot_in == "user":
        assert all(isinstance(m["content"], str) for m in messages if m["role"] == "tool")
        screens = [m for m in messages[2:] if m["role"] == "user"]
        assert len(screens) == k
        assert all(_text(m) == SCREEN_TEXT for m in screens)
    else:
        assert [m["role"] for m in messages].count("user") == 1


def test_data_urls_round_trip_exactly(episode):
    url = image_data_url(episode.first_image)
    assert url.startswith("data:image/png;base64,")
    (back,) = message_images(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    )
    assert np.array_equal(np.asarray(back), np.asarray(episode.first_image))
    with pytest.raises(ValueError, match="data: URLs"):
        message_images(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        )
    with pytest.raises(ValueError, match="screenshot_in"):
        agent_messages("s", "t", episode.first_image, [], screenshot_in="elsewhere")


def test_url_and_pil_parts_render_the_same_prompt(episode, tool_tiny):
    processor = tool_tiny.processor
    texts = [
        processor.apply_chat_template(episode.messages(4, as_url=u), True, tools=episode.tools)
        for u in (True, False)
    ]
    assert texts[0] == texts[1] and texts[0].count("<|image_pad|>") == 3


@pytest.mark.parametrize("screenshot_in", ["tool", "user"])
def test_a_resent_history_re_renders_the_same_text(episode, tool_tiny, screenshot_in):
    """Without a window, the prompt before call k, then the call as the model emits it (hermes text and
    <|im_end|>), is exactly the start of the prompt before call k + 1: the template renders an assistant tool
    call as hermes_text, and arguments re-serialise identically."""
    processor, tools = tool_tiny.processor, episode.tools
    for k in range(len(episode.steps) - 1):
        before = processor.apply_chat_template(
            episode.messages(k, screenshot_in=screenshot_in, window=None), True, tools=tools
        )
        after = processor.apply_chat_template(
            episode.messages(k + 1, screenshot_in=screenshot_in, window=None), True, tools=tools
        )
        assert after.startswith(before + hermes_text(episode.steps[k].call) + "<|im_end|>\n")
        assert parse_tool_calls(after[len(before) :]) == [episode.steps[k].call]


def test_parse_tool_calls_skips_malformed_blocks():
    text = '<tool_call>\n{"name": "click", "arguments": {"target": "ok"}}\n</tool_call><tool_call>{oops}</tool_call>'
    assert parse_tool_calls(text) == [FunctionCall("click", {"target": "ok"})]
    assert (
        parse_tool_calls('<tool_call>{"name": 3}</tool_call>') == [] and parse_tool_calls("click(ok)") == []
    )
    assert hermes_text(FunctionCall("fill", {"field": "note", "text": "admin"})) == (
        '<tool_call>\n{"name": "fill", "arguments": {"field": "note", "text": "admin"}}\n</tool_call>'
    )


@pytest.mark.parametrize("screenshot_in", ["tool", "user"])
@pytest.mark.parametrize("window", [1, 2, 3, None])
def test_trimming_a_full_history_gives_the_windowed_one(episode, screenshot_in, window):
    """An agent that keeps every screenshot and trims before sending (keep_last_screenshots) sends exactly the
    list agent_messages builds with that window; the full history it keeps is unchanged."""
    for k in range(len(episode.steps) + 1):
        full = episode.messages(k, screenshot_in=screenshot_in, window=None)
        kept = json.dumps(full)
        assert keep_last_screenshots(full, window) == episode.messages(
            k, screenshot_in=screenshot_in, window=window
        )
        assert json.dumps(full) == kept
    with pytest.raises(ValueError, match="window"):
        keep_last_screenshots(full, 0)


@pytest.mark.parametrize("screenshot_in", ["tool", "user"])
def test_tool_result_messages_are_agent_messages_own(episode, screenshot_in):
    """An agent that appends each call and tool_result_messages builds the list agent_messages gives."""
    built = episode.messages(0, screenshot_in=screenshot_in, window=None)
    for k, step in enumerate(episode.steps):
        built.append({"role": "assistant", "content": None, "tool_calls": [step.call.to_openai(f"call_{k}")]})
        built += tool_result_messages(f"call_{k}", step.result, step.image, screenshot_in)
    assert built == episode.messages(len(episode.steps), screenshot_in=screenshot_in, window=None)
    with pytest.raises(ValueError, match="screenshot_in"):
        tool_result_messages("c", "t", episode.first_image, "elsewhere")
