"""The OpenAI chat-completions request as pydantic models, and the OpenAI error object.

Parameters mmkv does not act on (``frequency_penalty``, ``tools``, ``user``, ...) are accepted and ignored, as
other OpenAI-compatible servers do; ``n`` other than 1 is refused. The mmkv extension ``"mmkv": {"reuse",
"seam"}`` (the ``openai`` client's ``extra_body``) overrides the server's policy for one request.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ImagePart",
    "MmkvOptions",
    "TextPart",
    "error_body",
    "validation_message",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", str_max_length=8 << 20)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _not_empty_list(cls, content):
        if isinstance(content, list) and not content:
            raise ValueError("content must be a string or a non-empty list of parts")
        return content


class StreamOptions(_Strict):
    include_usage: bool = False


class MmkvOptions(_Strict):
    reuse: Literal["kv", "encoder", "none"] | None = None  # this request's reuse policy
    seam: int | None = Field(default=None, ge=0, le=4096)  # this request's seam


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    mmkv: MmkvOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` or its older name ``max_tokens`` (None: the server's bound)."""
        return self.max_completion_tokens or self.max_tokens


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter of pydantic's first error."""
    first = error.errors()[0]
    location = ".".join(str(x) for x in first.get("loc", ()))
    return f"{location}: {first.get('msg', 'invalid value')}" if location else first.get(
        "msg", ""
    ), location or None


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
