"""Agent frameworks nobody here wrote, unchanged, against a real ``mmkv serve``: langchain-openai, pydantic-ai
and openai-agents each get a tool call (their own function tools, their own parsing) and a structured output
(their own pydantic models, validated by them). The tiny model's weights are random: constrained decoding is
what makes the calls and the outputs valid, whatever the weights."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.frameworks

MODEL = "tiny-qwen3-vl"


class Verdict(BaseModel):
    """The structured answer every framework asks for."""

    action: Literal["approve", "escalate", "wait"]
    confidence: int = Field(ge=0, le=9)
    reason: str = Field(max_length=12)


def test_langchain_bind_tools_and_structured_output(server):
    """langchain-openai: ``bind_tools`` with a named tool choice yields a tool call of that tool with valid
    arguments; ``with_structured_output`` (json_schema) yields a validated ``Verdict``."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def click(target: Literal["approve", "submit"]) -> str:
        """Click a button on the screen."""
        return f"clicked {target}"

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", temperature=0, max_tokens=200,
                     max_retries=0)  # fmt: skip
    message = llm.bind_tools([click], tool_choice="click").invoke("What is the next action?")
    (call,) = message.tool_calls
    assert call["name"] == "click" and call["args"]["target"] in ("approve", "submit")
    assert click.invoke(call["args"]).startswith("clicked")
    verdict = llm.with_structured_output(Verdict, method="json_schema").invoke("Give your verdict.")
    assert isinstance(verdict, Verdict)


def test_pydantic_ai_tools_and_output_types(server):
    """pydantic-ai: an agent whose output type is a model (its tool-output mode: a required final_result call)
    and one with native structured output both return a validated ``Verdict``; a function tool the agent must
    call runs with validated arguments."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        MODEL, provider=OpenAIProvider(base_url=f"{server.base_url}/v1", api_key="unused")
    )
    settings = {"temperature": 0, "max_tokens": 200}
    assert isinstance(
        Agent(model, output_type=Verdict, model_settings=settings).run_sync("Verdict?").output, Verdict
    )
    native = Agent(model, output_type=NativeOutput(Verdict), model_settings=settings).run_sync("Verdict?")
    assert isinstance(native.output, Verdict)
    clicked = []

    def click(target: Literal["approve", "submit"]) -> Verdict:
        """Click a button on the screen; the click's outcome is the verdict."""
        clicked.append(target)
        return Verdict(action="approve", confidence=5, reason="clicked")

    agent = Agent(
        model, output_type=[click], model_settings=settings
    )  # an output function: it must be called
    assert agent.run_sync("What is the next action?").output.reason == "clicked"
    assert clicked and clicked[0] in ("approve", "submit")


def test_openai_agents_chat_completions_model(server):
    """openai-agents over ``OpenAIChatCompletionsModel``: a function tool called (tool_choice required, the run
    stopping at the first tool result) and an output type returned as a validated ``Verdict``."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    clicked = []

    @function_tool
    def click(target: Literal["approve", "submit"]) -> str:
        """Click a button on the screen."""
        clicked.append(target)
        return f"clicked {target}"

    settings = ModelSettings(temperature=0, max_tokens=200)

    async def run():
        actor = Agent(name="actor", instructions="Act.", model=model, tools=[click],
                      model_settings=settings.resolve(ModelSettings(tool_choice="required")),
                      tool_use_behavior="stop_on_first_tool")  # fmt: skip
        acted = await Runner.run(actor, "What is the next action?", max_turns=2)
        judge = Agent(
            name="judge", instructions="Judge.", model=model, output_type=Verdict, model_settings=settings
        )
        judged = await Runner.run(judge, "Give your verdict.", max_turns=2)
        return acted.final_output, judged.final_output

    acted, judged = asyncio.run(run())
    assert clicked and acted == f"clicked {clicked[0]}"
    assert isinstance(judged, Verdict)
