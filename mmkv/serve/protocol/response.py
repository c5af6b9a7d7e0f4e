"""The chat-completions response objects as pydantic models: a whole completion, a stream's chunks, usage, tool
calls and logprobs, as OpenAI returns them (plus the ``mmkv`` object: where each image's KV came from)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "AssistantOut",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "ChoiceDelta",
    "FunctionCallOut",
    "FunctionDelta",
    "PromptTokensDetails",
    "ChatCompletionTokenLogprob",
    "ToolCallDelta",
    "ToolCallOut",
    "TopLogprob",
    "Usage",
]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCallOut(_Out):
    name: str
    arguments: str


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatCompletionTokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[ChatCompletionTokenLogprob] | None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class AssistantOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Choice(_Out):
    index: int = 0
    message: AssistantOut
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    mmkv: dict[str, Any]  # where each image came from, tokens prefilled and reused, TTFT, queue time


class FunctionDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChoiceDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Out):
    index: int = 0
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    mmkv: dict[str, Any] | None = None


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Out):
    error: ErrorDetail
