"""Environments an agent acts on: ``DesktopApp``, a simulated ticket desk driven through OpenAI function tools.

``DesktopApp(split).reset(seed)`` gives the task and the first screenshot; ``tools()`` the tool specs;
``step(name, arguments)`` the result text, the next screenshot and whether the call was right;
``expected_call()`` the right call now. ``expert_episode(seed, split)`` plays an episode right;
``agent_messages`` / ``Episode.messages`` build the chat-completions messages an agent resends each turn (a
window of the last N screenshots, in tool messages or in user messages); ``hermes_text`` / ``parse_tool_calls``
are the tool-call text the models emit.
"""

from __future__ import annotations

from ..toolcalls import FunctionCall
from .desktop import POLICY, DesktopApp, Observation, StepResult
from .episodes import Episode, EpisodeStep, expert_episode
from .messages import (
    SCREEN_TEXT,
    agent_messages,
    image_data_url,
    keep_last_screenshots,
    message_images,
    tool_result_messages,
)
from .tools import TOOLS, hermes_text, parse_tool_calls, tool_specs

__all__ = [
    "POLICY",
    "SCREEN_TEXT",
    "TOOLS",
    "DesktopApp",
    "Episode",
    "EpisodeStep",
    "Observation",
    "StepResult",
    "FunctionCall",
    "agent_messages",
    "expert_episode",
    "hermes_text",
    "image_data_url",
    "keep_last_screenshots",
    "message_images",
    "parse_tool_calls",
    "tool_result_messages",
    "tool_specs",
]
