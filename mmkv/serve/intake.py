"""A checked chat-completions request turned into mmkv's records: the ``Conversation`` (messages, images, tool
calls, tool results, declared tools), the ``TurnPolicy``, the ``DecodeOptions`` and the grammar the answer must
follow. Everything a client sends is untrusted: each refusal is an ``ApiError`` (or an ``mmkv.MmkvError``, which
the HTTP layer maps by type) raised before anything shared changes.

How tools and formats decide decoding (``Intake.grammar``):

| tools | tool_choice | response_format | the answer |
|---|---|---|---|
| none, or ``none`` | - | text | free text |
| none, or ``none`` | - | json_object / json_schema | JSON (grammar) |
| listed | ``auto`` (default) | text | free text, read for ``<tool_call>`` blocks |
| listed | ``auto`` | json | tool call(s) or JSON (grammar) |
| listed | ``required`` / named | text | tool call(s) of a listed / the named function, arguments valid (grammar) |
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from PIL import Image

from ..conversation import Conversation
from ..messages import ConversationImage, ToolCall
from ..runtime import DecodeOptions, LogitRules, Sampling, TurnPolicy
from ..runtime.grammar import GrammarSpec, json_object, json_schema, tool_calls, tool_calls_or
from .protocol import BadRequest, ChatCompletionRequest, ImagePart, NamedToolChoice, TooLarge

__all__ = ["LOW_DETAIL_SIDE", "Intake", "bytes_key", "low_detail", "read_request"]

LOW_DETAIL_SIDE = 512  # image_url.detail "low": the image is shrunk to fit a square of this side first


@dataclass(frozen=True)
class Intake:
    """What one request asks the model to do."""

    conversation: Conversation  # the messages as mmkv holds them (images decoded, keyed, preprocessed)
    policy: TurnPolicy  # the server's, with the request's "mmkv" overrides
    options: DecodeOptions  # budget, sampling, stops, logprobs, penalties
    grammar: GrammarSpec | None  # what the answer must be, or None (free text)
    read_tool_calls: bool  # whether the answer is read for tool calls (tools listed, tool_choice not "none")
    calls_trusted: bool  # the grammar makes the answer well-formed calls (they may stream at once)
    url_schemes: tuple[str, ...]  # each image's URL scheme, for the log line


def read_request(
    body: ChatCompletionRequest,
    base_policy: TurnPolicy,
    max_tokens: int,
    max_images: int,
    decode_image: Callable[[bytes, str], ConversationImage],
    read_url: Callable[[str], bytes],
    max_schema_bytes: int = 64 << 10,
    deadline: float | None = None,
) -> Intake:
    """``body`` as an ``Intake``. ``decode_image(data, detail)``: an encoded image's record (decoded, keyed,
    preprocessed; raises the ``mmkv.ImageError`` of a bad one); ``read_url(url)``: an image URL's bytes under the
    server's media rules (raises ``MediaError``). The grammar comes first (a schema over ``max_schema_bytes`` or
    that cannot be enforced is refused before any image is decoded), its checks waiting for their turn until
    ``deadline``. Raises ``BadRequest`` / ``TooLarge`` naming the field, ``GrammarError`` (a 400),
    ``GrammarTimeoutError`` (a 504)."""
    grammar, read_calls, trusted = _grammar(body, max_schema_bytes, deadline)
    conversation, schemes = Conversation(), []
    # declared whatever the tool choice ("none" too): the prompt then stays the same from turn to turn
    conversation.set_tools([tool.model_dump(exclude_none=True) for tool in body.tools or ()])

    def add_parts(parts, role: str) -> None:
        for number, part in enumerate(parts):
            first = number == 0 and role != "tool"
            if not isinstance(part, ImagePart):
                conversation.add_text(part.text, role, new_message=first)
                continue
            schemes.append(part.image_url.url.split(":", 1)[0].lower()[:16])
            if len(schemes) > max_images:
                raise TooLarge(f"a request holds at most {max_images} images", "messages")
            record = decode_image(read_url(part.image_url.url), part.image_url.detail)
            conversation.add_image(record, role, new_message=first)

    for message in body.messages:
        role = "system" if message.role == "developer" else message.role
        if role == "tool":
            conversation.add_tool_response(message.tool_call_id)
        if role == "assistant" and message.tool_calls:
            text = (
                message.content
                if isinstance(message.content, str)
                else "".join(p.text for p in message.content or ())
            )
            calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
            conversation.add_tool_calls(calls, text)
            continue
        content = message.content
        if isinstance(content, str):
            if role == "tool":
                conversation.add_text(content, role)
            else:
                conversation.add_text(content, role, new_message=True)
            continue
        add_parts(content, role)
    overrides = {} if body.mmkv is None else body.mmkv.model_dump(exclude_none=True)
    return Intake(
        conversation, replace(base_policy, **overrides), _options(body, max_tokens), grammar, read_calls, trusted,
        tuple(schemes),
    )  # fmt: skip


def _options(body: ChatCompletionRequest, max_tokens: int) -> DecodeOptions:
    """Budget, sampling, stops, logprobs and penalties of ``body`` (within the server's ``max_tokens``)."""
    if (body.token_limit or 0) > max_tokens:
        raise BadRequest(f"max_tokens is over this server's bound of {max_tokens}", "max_tokens")
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    sampling = (
        Sampling(body.temperature, body.top_p, body.seed, top_k) if body.temperature > 0 else Sampling()
    )
    bias = tuple((int(token), float(value)) for token, value in (body.logit_bias or {}).items())
    rules = LogitRules(body.presence_penalty, body.frequency_penalty, body.repetition_penalty or 1.0, bias)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return DecodeOptions(
        min(body.token_limit or max_tokens, max_tokens), sampling, tuple(body.stop or ()), logprobs, rules
    )


def _grammar(
    body: ChatCompletionRequest, max_schema_bytes: int, deadline: float | None
) -> tuple[GrammarSpec | None, bool, bool]:
    """The grammar the answer must follow, whether to read it for tool calls, and whether those are grammar-made
    (see the module docstring). Every listed tool is checked whatever the tool choice (``none`` and ``auto``
    too: the same list gets the same verdict). Raises ``BadRequest`` for schemas over ``max_schema_bytes``,
    ``GrammarError`` (a 400) for a schema or tool list that cannot be one."""
    form = body.response_format
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    _check_schema_bytes(body, tools, max_schema_bytes)
    answer = None
    if form is not None and form.type == "json_object":
        answer = json_object(deadline)
    elif form is not None and form.type == "json_schema":
        answer = json_schema(form.json_schema.schema_, bool(form.json_schema.strict), deadline)
    choice = body.tool_choice or ("auto" if tools else "none")
    listed = tool_calls(tools, "required", body.parallel_tool_calls, deadline) if tools else None
    if listed is None or choice == "none":
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise BadRequest("tool_choice asks for a tool call but no tools are listed", "tool_choice")
        return answer, False, False
    if choice == "auto":
        if answer is None:
            return None, True, False
        return tool_calls_or(listed, answer, deadline), True, True
    if choice == "required":
        return listed, True, True
    return tool_calls(tools, {"name": choice.function.name}, False, deadline), True, True


def _check_schema_bytes(body: ChatCompletionRequest, tools: list[dict], max_schema_bytes: int) -> None:
    """Refuse a request whose JSON schemas (the response format's, every tool's parameters) take more than
    ``max_schema_bytes`` of JSON together: checking and compiling a schema costs time and memory in its size."""
    form = body.response_format
    schemas = [form.json_schema.schema_] if form is not None and form.json_schema is not None else []
    schemas += [tool["function"].get("parameters") for tool in tools]
    num_bytes, param = 0, "response_format"
    for number, schema in enumerate(schemas):
        num_bytes += len(json.dumps(schema).encode()) if schema is not None else 0
        if num_bytes > max_schema_bytes:
            if number >= len(schemas) - len(tools):
                param = "tools"
            raise BadRequest(
                f"the request's JSON schemas (response format and tools' parameters) take over {max_schema_bytes:,}"
                " bytes, this server's bound (--max-schema-bytes); send smaller schemas",
                param,
            )


def low_detail(image: Image.Image) -> Image.Image:
    """``image`` shrunk (aspect kept) to fit a ``LOW_DETAIL_SIDE`` square: ``image_url.detail: "low"``."""
    if max(image.size) <= LOW_DETAIL_SIDE:
        return image
    scale = LOW_DETAIL_SIDE / max(image.size)
    return image.resize(
        (max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BICUBIC
    )


def bytes_key(data: bytes, detail: str) -> str:
    """The key of an encoded image's record: the hash of its bytes and the detail it was read at."""
    return hashlib.sha256(data).hexdigest() + ("" if detail != "low" else ":low")
