"""read_request, without a model: images counted over the whole request and refused past the bound before the
next is read, grammars checked before any image is touched, the tools x tool_choice x response_format table,
decoding options within the server's bounds, the request's policy overrides, and the image-record keys."""

from __future__ import annotations

import pytest
from PIL import Image

from mmkv.errors import GrammarError
from mmkv.runtime import GREEDY, TurnPolicy
from mmkv.serve.intake import LOW_DETAIL_SIDE, bytes_key, low_detail, read_request
from mmkv.serve.protocol import BadRequest, ChatCompletionRequest, TooLarge
from tests.helpers import synthetic_image

TOOL = {"type": "function", "function": {"name": "click", "parameters": {"type": "object",
        "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}  # fmt: skip
SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


class Reader:
    """read_url and decode_image stand-ins that record what they were asked, in order."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.decoded: list[tuple[bytes, str]] = []

    def read(self, url: str) -> bytes:
        self.urls.append(url)
        return url.encode()

    def decode(self, data: bytes, detail: str):
        self.decoded.append((data, detail))
        return synthetic_image(f"d{len(self.decoded)}")


def _image(url: str, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def _read(
    body: dict, reader: Reader | None = None, max_images: int = 8, max_schema_bytes: int = 1 << 16, **kw
):
    reader = reader or Reader()
    request = ChatCompletionRequest.model_validate({"model": "m"} | body)
    return read_request(
        request, TurnPolicy(), 64, max_images, reader.decode, reader.read, max_schema_bytes, **kw
    )


def test_images_are_counted_over_the_request_and_the_one_past_the_bound_is_never_read():
    reader = Reader()
    messages = [{"role": "user", "content": [_image("data:a"), {"type": "text", "text": "and"}, _image("HTTPS://b")]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [_image("file:///c", "low"), _image("data:d")]}]  # fmt: skip
    with pytest.raises(TooLarge, match="at most 3 images") as refused:
        _read({"messages": messages}, reader, max_images=3)
    assert refused.value.param == "messages" and reader.urls == ["data:a", "HTTPS://b", "file:///c"]
    intake = _read({"messages": messages}, Reader(), max_images=4)
    assert intake.url_schemes == ("data", "https", "file", "data")
    assert [image.digest for image in intake.conversation.images] == ["d1", "d2", "d3", "d4"]
    detail = Reader()
    _read({"messages": messages}, detail)
    assert [d for _, d in detail.decoded] == ["auto", "auto", "low", "auto"]


def _tool(name: str, padding: int = 0) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "description": "y" * padding}}}}}  # fmt: skip


@pytest.mark.parametrize(
    "body, error, param",
    [({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "description": "x" * 300}}}}, BadRequest, "response_format"),
     ({"tools": [_tool("a", 100), _tool("b", 100), _tool("c", 100)]}, BadRequest, "tools"),
     ({"tool_choice": "required"}, BadRequest, "tool_choice"),
     ({"tools": [_tool("a"), _tool("a")]}, GrammarError, None)],
)  # fmt: skip
def test_a_refused_grammar_is_refused_before_any_image_is_read(body, error, param):
    reader = Reader()
    messages = [{"role": "user", "content": [_image("data:a"), {"type": "text", "text": "hi"}]}]
    with pytest.raises(error) as refused:
        _read({"messages": messages} | body, reader, max_schema_bytes=256)
    assert getattr(refused.value, "param", None) == param and reader.urls == [] and reader.decoded == []


@pytest.mark.parametrize(
    "tools, choice, form, grammar, reads_calls, trusted",
    [(None, None, None, False, False, False), ([TOOL], "none", None, False, False, False),
     (None, None, SCHEMA, True, False, False), ([TOOL], "none", {"type": "json_object"}, True, False, False),
     ([TOOL], None, None, False, True, False), ([TOOL], "auto", SCHEMA, True, True, True),
     ([TOOL], "required", None, True, True, True),
     ([TOOL], {"type": "function", "function": {"name": "click"}}, None, True, True, True)],
)  # fmt: skip
def test_tools_choice_and_format_decide_the_grammar_as_the_table_says(
    tools, choice, form, grammar, reads_calls, trusted
):
    body = {"messages": [{"role": "user", "content": "go"}]}
    body |= {
        k: v
        for k, v in (("tools", tools), ("tool_choice", choice), ("response_format", form))
        if v is not None
    }
    intake = _read(body)
    assert (intake.grammar is not None, intake.read_tool_calls, intake.calls_trusted) == (
        grammar,
        reads_calls,
        trusted,
    )
    assert intake.conversation.tools == tools  # declared whatever the choice ("none" too)


def test_decoding_options_stay_within_the_server_s_bounds():
    user = {"messages": [{"role": "user", "content": "go"}]}
    with pytest.raises(BadRequest, match="over this server's bound of 64") as refused:
        _read(user | {"max_tokens": 65})
    assert refused.value.param == "max_tokens"
    default = _read(user).options
    assert default.max_new_tokens == 64 and default.logprobs is None and default.rules.is_neutral
    assert default.sampling.temperature == 1.0 == default.sampling.top_p  # OpenAI's defaults: sampled
    asked = _read(user | {"max_completion_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"],
                          "logprobs": True, "top_logprobs": 2, "logit_bias": {"7": -5}}).options  # fmt: skip
    assert (asked.max_new_tokens, asked.stops, asked.logprobs, asked.rules.logit_bias) == (
        5,
        ("\n",),
        2,
        ((7, -5.0),),
    )
    assert (asked.sampling.temperature, asked.sampling.top_p, asked.sampling.seed) == (0.7, 0.9, 3)
    assert _read(user | {"temperature": 0}).options.sampling == GREEDY


def test_the_request_s_overrides_replace_the_server_s_policy_and_roles_map():
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "go"}],
            "mmkv": {"reuse": "encoder", "seam": 3}}  # fmt: skip
    intake = _read(body)
    assert (intake.policy.reuse, intake.policy.seam) == ("encoder", 3)
    assert _read({"messages": body["messages"]}).policy == TurnPolicy()
    assert [m.role for m in intake.conversation.messages] == ["system", "user"]


def test_low_detail_fits_the_square_keeping_the_aspect_and_keys_tell_details_apart():
    wide, small = Image.new("RGB", (2048, 512)), Image.new("RGB", (300, 200))
    assert low_detail(wide).size == (LOW_DETAIL_SIDE, LOW_DETAIL_SIDE // 4) and low_detail(small) is small
    assert low_detail(Image.new("RGB", (5000, 1))).size == (LOW_DETAIL_SIDE, 1)
    assert (
        bytes_key(b"x", "low")
        != bytes_key(b"x", "auto")
        == bytes_key(b"x", "high")
        != bytes_key(b"y", "auto")
    )
