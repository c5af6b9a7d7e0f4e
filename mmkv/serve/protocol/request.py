"""The chat-completions request as pydantic models, every documented field declared.

Nothing is silently ignored: every documented request field is declared here and either honoured or refused
with a 400 that names it (``REFUSED`` below); a field nobody documents gets OpenAI's own answer, 400
"Unrecognized request argument supplied: <name>". Vendor fields honoured: ``mmkv`` (the reuse policy of one
request), vLLM's ``top_k`` and ``repetition_penalty``; ``chat_template_kwargs`` is accepted only empty. The
README's Serve section has the table of every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...policy import MAX_SEAM, RepairKind, ReusePolicy
from ...runtime.decode import MAX_LOGPROBS
from ...runtime.sampling import SEED_RANGE

__all__ = ["REFUSED", "ChatCompletionRequest", "ImagePart", "MmkvOptions", "NamedToolChoice", "TextPart"]

STRING_BOUND = 64 << 20  # no single string field may exceed this (the body bound says more)


class _In(BaseModel):
    """A request object: unknown fields are refused (OpenAI's "Unrecognized request argument")."""

    model_config = ConfigDict(extra="forbid", str_max_length=STRING_BOUND)


class TextPart(_In):
    type: Literal["text"]
    text: str


class ImageURL(_In):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"  # low: the image is shrunk to fit 512x512 first


class ImagePart(_In):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCallIn(_In):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, rendered as given


class ToolCallIn(_In):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


def _some_content(content):
    if isinstance(content, list) and not content:
        raise ValueError("content must be a string or a non-empty list of parts")
    return content


class SystemMessage(_In):
    role: Literal["system", "developer"]  # developer is OpenAI's newer name for system
    content: str | list[TextPart]
    name: str | None = None  # accepted, not rendered (the Qwen templates have no place for it)
    _check = field_validator("content")(_some_content)


class UserMessage(_In):
    role: Literal["user"]
    content: str | list[Part]
    name: str | None = None
    _check = field_validator("content")(_some_content)


class AssistantMessage(_In):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)
    name: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _something(self):
        if not self.content and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.refusal:
            raise ValueError("assistant messages with a refusal are not supported; send its text as content")
        return self


class ToolMessage(_In):
    role: Literal["tool"]
    content: str | list[Part]  # images in tool results: how agents return screenshots
    tool_call_id: str = Field(min_length=1, max_length=256)


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDef(_In):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_In):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(_In):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_In):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class StreamOptions(_In):
    include_usage: bool = False
    include_obfuscation: bool = False  # refused when true (no obfuscation padding is sent)


class MmkvOptions(_In):
    """A request's overrides of the server's ``TurnPolicy`` (the values are the policy's own types)."""

    reuse: ReusePolicy | None = None  # this request's reuse policy
    seam: int | None = Field(default=None, ge=0, le=MAX_SEAM)  # this request's seam
    repair: RepairKind | None = None  # how spliced tokens beyond the seam are chosen
    budget: float | None = Field(
        default=None, ge=0.0, le=1.0, allow_inf_nan=False
    )  # share of them recomputed


# Documented OpenAI fields this server refuses when set (None / empty / the neutral value is accepted), and why.
REFUSED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported (modalities ['text'])",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this model does not reason in a separate channel",
    "verbosity": "verbosity is not supported",
    "functions": "the deprecated functions field is not supported; use tools",
    "function_call": "the deprecated function_call field is not supported; use tool_choice",
    "store": "stored completions are not supported (store must be false)",
    "metadata": "metadata is only kept with stored completions, which are not supported",
    "service_tier": "service tiers other than 'auto' and 'default' are not supported",
    "chat_template_kwargs": "chat_template_kwargs are not supported (the server renders with the model's template)",
}


class ChatCompletionRequest(_In):
    model: str
    messages: list[Message] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    user: str | None = None  # logged
    safety_identifier: str | None = None  # logged
    prompt_cache_key: str | None = None  # logged (mmkv caches by content, not by key)
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    # vendor extras
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 or 0 for no bound
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # vLLM
    chat_template_kwargs: dict[str, Any] | None = None
    mmkv: MmkvOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias):
        for key, value in (bias or {}).items():
            if not key.isdigit() or not -100.0 <= value <= 100.0:
                raise ValueError("logit_bias maps token ids (digits) to biases in [-100, 100]")
        return bias

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` or its older name ``max_tokens`` (None: the server's bound)."""
        return self.max_completion_tokens or self.max_tokens

    def refused(self) -> tuple[str, str] | None:
        """The first documented field set to something this server does not do: ``(name, why)``; None if none."""
        neutral = {
            "modalities": lambda v: v in (None, ["text"]),
            "store": lambda v: not v,
            "metadata": lambda v: not v,
            "service_tier": lambda v: v in (None, "auto", "default"),
            "chat_template_kwargs": lambda v: not v,
        }
        for name, why in REFUSED.items():
            value = getattr(self, name)
            if not neutral.get(name, lambda v: v is None)(value):
                return name, why
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            return "stream_options.include_obfuscation", "obfuscation padding is not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        is_format = self.response_format is not None and self.response_format.type != "text"
        is_call = bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        )
        if is_format and is_call:
            return (
                "response_format",
                "a response format with a required or named tool choice (the answer is a call)",
            )
        if self.stop and (is_format or is_call):
            return "stop", ("a stop sequence would cut an answer that must be JSON or tool calls (a JSON response "
                            "format, a required or named tool choice) short; send it without stop")  # fmt: skip
        return None
