"""An agent's chat-completions messages, exactly as it resends them each turn, with a window of screenshots.

``agent_messages`` builds the OpenAI message list of an episode so far::

    system     the policy
    user       [task text, screenshot 0]
    assistant  tool_calls=[{id: "call_0", function: {name, arguments: JSON string}}]
    tool       tool_call_id="call_0", [result text, screenshot 1]        (screenshot_in="tool")
      or tool  "result text"  +  user [text "The screen now.", screenshot 1]   (screenshot_in="user")
    assistant  ...

Only the last ``window`` screenshots keep their image part; older ones are dropped (their text stays), as a
computer-use agent does to bound its prompt. Image parts are ``image_url`` parts with ``data:image/png;base64``
URLs (``image_data_url``), or, with ``as_url=False``, ``{"type": "image", "image": <PIL image>}`` parts, which
the chat templates render the same way (for training without an encode/decode round trip). ``message_images``
returns the images of a message list in prompt order.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Literal, Protocol

from PIL import Image

from ..toolcalls import FunctionCall

__all__ = [
    "SCREEN_TEXT", "ScreenshotIn", "StepLike", "agent_messages", "image_data_url", "keep_last_screenshots",
    "message_images", "tool_result_messages",
]  # fmt: skip

ScreenshotIn = Literal["tool", "user"]
SCREEN_TEXT = (
    "The screen now."  # the text of the user message that carries a screenshot (screenshot_in="user")
)


class StepLike(Protocol):
    """One step of an episode as ``agent_messages`` reads it (``EpisodeStep`` is one)."""

    call: FunctionCall  # what the agent called
    result: str  # the tool's text result
    image: Image.Image  # the screenshot after the call


def image_data_url(image: Image.Image) -> str:
    """``data:image/png;base64,...`` of ``image`` (PNG, lossless: decodes to the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _image_part(image: Image.Image, as_url: bool) -> dict:
    if as_url:
        return {"type": "image_url", "image_url": {"url": image_data_url(image)}}
    return {"type": "image", "image": image}


def _content(text: str, image: Image.Image | None, as_url: bool) -> str | list[dict]:
    """A message's content: the text alone as a string, or the text then the image as parts."""
    if image is None:
        return text
    return [{"type": "text", "text": text}, _image_part(image, as_url)]


def agent_messages(
    system: str,
    task: str,
    first_screenshot: Image.Image,
    steps: Sequence[StepLike],
    *,
    screenshot_in: ScreenshotIn = "tool",
    window: int | None = 3,
    as_url: bool = True,
) -> list[dict]:
    """The message list an agent sends after ``steps`` (the next assistant turn is the model's to write).

    ``window``: screenshots that keep their image part, counting back from the latest (``None``: all).
    Tool-call ids are ``call_0``, ``call_1``, ... in order; ``function.arguments`` is ``json.dumps`` of the
    arguments (default separators). Pure: the same inputs give equal lists. Raises ``ValueError`` for an unknown
    ``screenshot_in`` or a window below 1."""
    if screenshot_in not in ("tool", "user"):
        raise ValueError(f"screenshot_in must be 'tool' or 'user', got {screenshot_in!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    screenshots = [first_screenshot, *(step.image for step in steps)]
    keep_from = 0 if window is None else max(0, len(screenshots) - window)

    def kept(index: int) -> Image.Image | None:
        return screenshots[index] if index >= keep_from else None

    messages: list[dict] = [
        {"role": "system", "content": system},
        {"role": "user", "content": _content(task, kept(0), as_url)},
    ]
    for number, step in enumerate(steps, start=1):
        call_id = f"call_{number - 1}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [step.call.to_openai(call_id)]})
        if screenshot_in == "tool":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _content(step.result, kept(number), as_url),
                }
            )
        else:
            messages.append({"role": "tool", "tool_call_id": call_id, "content": step.result})
            messages.append({"role": "user", "content": _content(SCREEN_TEXT, kept(number), as_url)})
    return messages


def tool_result_messages(
    call_id: str, text: str, screenshot: Image.Image | str, screenshot_in: ScreenshotIn = "tool"
) -> list[dict]:
    """The messages answering call ``call_id`` with ``text`` and the next ``screenshot`` (a picture, or its data
    URL), as ``agent_messages`` places them: one tool message ``[text, image]``, or (``screenshot_in="user"``) a
    tool message with the text then a user message ``[SCREEN_TEXT, image]``. Pure."""
    url = screenshot if isinstance(screenshot, str) else image_data_url(screenshot)
    image = {"type": "image_url", "image_url": {"url": url}}
    if screenshot_in == "tool":
        return [{"role": "tool", "tool_call_id": call_id, "content": [{"type": "text", "text": text}, image]}]
    if screenshot_in != "user":
        raise ValueError(f"screenshot_in must be 'tool' or 'user', got {screenshot_in!r}")
    return [
        {"role": "tool", "tool_call_id": call_id, "content": text},
        {"role": "user", "content": [{"type": "text", "text": SCREEN_TEXT}, image]},
    ]


def _is_image(part: dict) -> bool:
    return part.get("type") in ("image", "image_url")


def keep_last_screenshots(messages: Sequence[dict], window: int | None) -> list[dict]:
    """``messages`` with only the last ``window`` image parts kept (``None``: all), as an agent trims the history
    it resends. A message that loses its images keeps its other parts; left with one text part, its content
    becomes that text, as ``agent_messages`` writes a dropped screenshot's message. Pure: the messages given are
    not changed (changed ones are copies). Raises ``ValueError`` for a window below 1.

    >>> shot = {"type": "image_url", "image_url": {"url": "data:,"}}
    >>> keep_last_screenshots([{"role": "user", "content": [{"type": "text", "text": "a"}, shot]},
    ...                        {"role": "tool", "content": [{"type": "text", "text": "b"}, shot]}], 1)[0]
    {'role': 'user', 'content': 'a'}
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    total = sum(_is_image(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])
    to_drop = 0 if window is None else max(0, total - window)
    kept = []
    for message in messages:
        content = message.get("content")
        if to_drop == 0 or not isinstance(content, list) or not any(_is_image(p) for p in content):
            kept.append(message)
            continue
        parts = []
        for part in content:
            if _is_image(part) and to_drop > 0:
                to_drop -= 1
            else:
                parts.append(part)
        if len(parts) == 1 and parts[0].get("type") == "text":
            parts = parts[0]["text"]
        kept.append({**message, "content": parts})
    return kept


def message_images(messages: Sequence[dict]) -> list[Image.Image]:
    """The images of ``messages`` in prompt order (``image_url`` data URLs decoded to RGB, ``image`` parts
    as given). Raises ``ValueError`` for an image URL that is not a base64 ``data:`` URL."""
    images = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") == "image":
                images.append(part["image"])
            elif part.get("type") == "image_url":
                url = part["image_url"]["url"]
                head, _, data = url.partition(",")
                if not (head.startswith("data:") and head.endswith(";base64")):
                    raise ValueError(f"only base64 data: URLs are decoded here, got {url[:40]!r}")
                images.append(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
    return images
