"""The desktop's episodes run by pydantic-ai, unchanged, against a ``mmkv serve``: the app's actions as its
function tools (with the app's own JSON schemas), each tool returning the action's result and the next screenshot
(``ToolReturn(text, content=[SCREEN_TEXT, BinaryContent(png)])``, which pydantic-ai sends as a user message after
the tool result: the app's ``screenshot_in="user"`` form), the last ``window`` screenshots kept by a history
processor, the run stopped once the app's episode is over. Used by ``tests/serve/test_agent_episodes.py``."""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass, field

import httpx
from openai import AsyncOpenAI

from mmkv.envs import SCREEN_TEXT, DesktopApp, FunctionCall, StepResult

__all__ = ["FrameworkEpisode", "pydantic_ai_episode"]


@dataclass
class FrameworkEpisode:
    """What one episode run by a framework did."""

    seed: int
    calls: list[FunctionCall] = field(default_factory=list)  # every call that reached the app, in order
    results: list[StepResult] = field(default_factory=list)  # what the app answered to each
    requests: list[dict] = field(default_factory=list)  # every chat-completions body the framework sent
    replies: list[dict] = field(default_factory=list)  # every reply's ``mmkv`` object
    answers: list[dict] = field(default_factory=list)  # every reply's message
    success: bool = False


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _keep_last_images(window: int):
    """A pydantic-ai history processor keeping only the last ``window`` images of the user prompts."""
    from pydantic_ai.messages import BinaryContent, ModelRequest, UserPromptPart

    def process(messages: list) -> list:
        seen, out = 0, []
        for message in reversed(messages):
            if isinstance(message, ModelRequest):
                parts = []
                for part in reversed(message.parts):
                    if isinstance(part, UserPromptPart) and not isinstance(part.content, str):
                        kept = []
                        for item in reversed(list(part.content)):
                            if isinstance(item, BinaryContent):
                                seen += 1
                                if seen > window:
                                    continue
                            kept.append(item)
                        part = UserPromptPart(list(reversed(kept)), timestamp=part.timestamp)
                    parts.append(part)
                message = ModelRequest(list(reversed(parts)), instructions=message.instructions)
            out.append(message)
        return list(reversed(out))

    return process


def pydantic_ai_episode(
    base_url: str, model: str, seed: int, *, split: str = "heldout", window: int = 3,
    force: str | list[str] | None = None,
) -> FrameworkEpisode:  # fmt: skip
    """Run the episode of ``(seed, split)`` with a pydantic-ai ``Agent`` over ``OpenAIChatModel``. ``force``: a
    ``tool_choice`` for every request (``"required"``, or a list of tool names; set per step by a capability,
    as pydantic-ai documents for forcing tools), for random-weight models; ``None``: the model decides
    (``auto``), and a text answer ends the run, as pydantic-ai ends runs."""
    from pydantic_ai import Agent, BinaryContent, Tool, ToolReturn
    from pydantic_ai.capabilities import AbstractCapability, ProcessHistory
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.profiles.openai import OpenAIModelProfile
    from pydantic_ai.providers.openai import OpenAIProvider

    app, episode = DesktopApp(split), FrameworkEpisode(seed)
    first = app.reset(seed)

    def act(name: str):
        def action(**arguments) -> ToolReturn:
            call = FunctionCall(name, arguments)
            result = app.step(name, arguments)
            episode.calls.append(call)
            episode.results.append(result)
            screen = BinaryContent(data=_png(result.image), media_type="image/png")
            return ToolReturn(return_value=result.text, content=[SCREEN_TEXT, screen])

        return action

    tools = [
        Tool.from_schema(act(spec["function"]["name"]), spec["function"]["name"], spec["function"]["description"],
                         spec["function"]["parameters"])
        for spec in app.tools()
    ]  # fmt: skip

    class ForceTools(AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: {"tool_choice": force}

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            episode.requests.append(json.loads(request.content))

    async def replies(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            await response.aread()
            body = response.json()
            episode.replies.append(body.get("mmkv", {}))
            episode.answers.append(body["choices"][0]["message"] if body.get("choices") else body)

    async def run() -> None:
        http = httpx.AsyncClient(event_hooks={"request": [record], "response": [replies]}, timeout=600)
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        # an OpenAI-compatible server of an open model: no OpenAI strict mode (as pydantic-ai's vLLM-style
        # profiles), so the tool specs go out as the app declares them
        profile = OpenAIModelProfile(openai_supports_strict_tool_definition=False)
        chat = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client), profile=profile)
        capabilities = [ProcessHistory(_keep_last_images(window))] + ([ForceTools()] if force else [])
        agent = Agent(chat, system_prompt=app.policy, tools=tools, capabilities=capabilities,
                      model_settings={"temperature": 0, "max_tokens": 96, "parallel_tool_calls": False})  # fmt: skip
        prompt = [first.text, BinaryContent(data=_png(first.image), media_type="image/png")]
        async with agent.iter(prompt) as running:
            async for _ in running:
                if app.done:  # the queue is empty or the step bound reached: the agent's work is over
                    break
        await http.aclose()

    asyncio.run(run())
    episode.success = app.success
    return episode
