"""Token constraints from grammars: whatever the logits, the answer parses, validates and ends; the mask never
offers the end of turn early, a vision token or an id past the tokenizer; bad specs raise with a useful message."""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable

import jsonschema
import pytest
import torch
from tokenizers import AddedToken

import mmkv
from mmkv.errors import GrammarError, MmkvError
from mmkv.model.tiny import train_tokenizer
from mmkv.runtime.grammar import (
    VISION_TOKENS,
    GrammarConstraint,
    TokenConstraint,
    Vocabulary,
    compile_grammar,
    constraint_for,
    grammar_cache,
    json_object,
    json_schema,
    tool_calls,
    vocabulary,
    vocabulary_of,
)
from mmkv.toolcalls import FunctionCall, format_tool_calls, parse_tool_calls
from tests.helpers import random_object, random_tools

# one or more calls as the templates write them, newline-joined, nothing else
_BLOCK = r'<tool_call>\n\{"name": "[\w-]+", "arguments": \{.*?\}\}\n</tool_call>'
HERMES_TEXT = re.compile(rf"{_BLOCK}(?:\n{_BLOCK})*", re.DOTALL)
MODELS = ["small-qwen3-vl", "small-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen2.5-vl"]
NUM_CASES = 20


@pytest.fixture(scope="module", params=MODELS)
def handle(request) -> mmkv.ModelHandle:
    """The small checkpoints (byte-level BPE, 700 tokens) and the tiny models (400 tokens)."""
    return mmkv.load(request.param, device="cpu")


# ---- random bounded schemas, and the most bytes a compact value of each can take ----


def max_bytes(schema: dict) -> int:
    """An upper bound on the bytes of any compact value of a schema from random_schema (a token is >= 1 byte)."""
    if "enum" in schema:
        return max(len(json.dumps(value).encode()) for value in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":
        return 2 + 6 * schema["maxLength"]  # an escape \uXXXX is the longest spelling of one character
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (max_bytes(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 4 + max_bytes(v) for k, v in schema["properties"].items())


def validates(schema: dict) -> Callable[[str], bool]:
    """Whether a text is one JSON value valid against ``schema``."""

    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    return check


def is_hermes(text: str) -> bool:
    """Whether a text is nothing but well-formed tool calls in the templates' layout."""
    if not text.endswith("</tool_call>"):  # (cheap first: the check runs on every step)
        return False
    parsed = parse_tool_calls(text)
    return bool(HERMES_TEXT.fullmatch(text)) and bool(parsed.calls) and not parsed.malformed


# ---- driving a constraint with random logits ----


def drive(
    constraint: TokenConstraint,
    tokenizer,
    vocab: Vocabulary,
    seed: int,
    max_steps: int,
    is_complete: Callable[[str], bool] | None = None,
) -> list[int]:
    """Greedy choice over seeded random logits under the mask until finished (or max_steps), checking on every
    step: the end of turn allowed iff the constraint accepts, and iff ``is_complete(text so far)`` when given;
    no vision token, no id past the tokenizer; allowed_ids() lists the mask."""
    generator = torch.Generator().manual_seed(seed)
    vision = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    assert vocab.end_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    for _ in range(max_steps):
        if constraint.is_finished():
            break
        mask = constraint.allowed()
        assert mask.shape == (vocab.vocab_size,) and mask.dtype == torch.bool and mask.any()
        assert bool(mask[vocab.end_id]) == constraint.is_accepting()
        if is_complete is not None:
            text = tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)  # (the Rust call: fast)
            assert bool(mask[vocab.end_id]) == is_complete(text), text
        assert not mask[vision].any() and not mask[len(tokenizer) :].any()
        assert torch.equal(constraint.allowed_ids(), torch.nonzero(mask).flatten())
        logits = torch.randn(vocab.vocab_size, generator=generator).masked_fill(~mask, float("-inf"))
        token = int(logits.argmax())
        constraint.advance(token)
        ids.append(token)
    return ids


def test_constraint_follows_the_protocol(handle):
    """A GrammarConstraint is a TokenConstraint; at the start of an object nothing but '{' is allowed."""
    constraint = constraint_for(handle, json_object())
    assert isinstance(constraint, TokenConstraint)
    allowed = torch.nonzero(constraint.allowed()).flatten().tolist()
    assert [handle.tokenizer.decode([i]) for i in allowed] == ["{"]


def test_json_schema_output_validates_and_ends(handle):
    """20 random bounded schemas, random logits: the text json.loads, validates, and the answer finishes within
    the schema's byte bound (strict and not strict alike); the end of turn is allowed exactly when the text so
    far is a valid answer."""
    vocab = vocabulary_of(handle)
    for seed in range(NUM_CASES):
        schema = random_object(random.Random(seed))
        spec = json_schema(schema, strict=seed % 2 == 0)
        bound = max_bytes(schema) + 1  # + the end of turn
        constraint = compile_grammar(vocab, spec).start()
        ids = drive(
            constraint, handle.tokenizer, vocab, seed, max_steps=bound + 1, is_complete=validates(schema)
        )
        assert len(ids) <= bound, (schema, handle.tokenizer.decode(ids))
        text = handle.tokenizer.decode(ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_output_is_an_object(handle):
    """Any-object mode: every answer that finishes within 300 tokens is one JSON object (most do)."""
    vocab = vocabulary_of(handle)
    finished = 0
    for seed in range(NUM_CASES):
        constraint = compile_grammar(vocab, json_object()).start()
        ids = drive(constraint, handle.tokenizer, vocab, seed, max_steps=300)
        if constraint.is_finished():
            finished += 1
            assert isinstance(json.loads(handle.tokenizer.decode(ids, skip_special_tokens=True)), dict)
    assert finished >= NUM_CASES // 2


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_calls_parse_and_validate(handle, parallel):
    """20 random tool lists, `required` and named in turn: the answer parses as hermes calls with nothing else,
    of listed tools (the named one when named), arguments valid; one call, or with parallel at least one; the
    end of turn is allowed exactly after a complete call."""
    vocab = vocabulary_of(handle)
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        tools = random_tools(rng)
        by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
        named = rng.choice(list(by_name)) if seed % 2 else None
        spec = tool_calls(tools, {"name": named} if named else "required", parallel=parallel)
        longest = max(
            len(format_tool_calls([FunctionCall(n, {})])) + max_bytes(p) for n, p in by_name.items()
        )
        steps = 20 * (longest + 1) if parallel else longest + 1
        constraint = compile_grammar(vocab, spec).start()
        ids = drive(constraint, handle.tokenizer, vocab, seed, max_steps=steps + 1, is_complete=is_hermes)
        text = handle.tokenizer.decode(ids, skip_special_tokens=True)
        assert len(ids) <= steps, text
        parsed = parse_tool_calls(text)
        assert parsed.malformed == () and parsed.content == "", text
        assert len(parsed.calls) >= 1 and (parallel or len(parsed.calls) == 1)
        assert HERMES_TEXT.fullmatch(text), text  # the template's layout, key order and separators
        for name, arguments in parsed.calls:
            assert name in by_name and (named is None or name == named)
            jsonschema.validate(arguments, by_name[name])


def test_end_of_turn_and_finish(handle):
    """After an object closes only the end of turn is allowed and the answer is finished; once the end of turn
    is taken nothing is allowed; is_finished implies is_accepting."""
    vocab = vocabulary_of(handle)
    constraint = constraint_for(
        handle, json_schema({"type": "object", "properties": {}, "additionalProperties": False})
    )
    for token in handle.tokenizer.encode("{}", add_special_tokens=False):
        assert not constraint.is_accepting() and not constraint.allowed()[vocab.end_id]
        constraint.advance(token)
    assert constraint.is_finished() and constraint.is_accepting()
    assert torch.nonzero(constraint.allowed()).flatten().tolist() == [vocab.end_id]
    constraint.advance(vocab.end_id)
    assert constraint.is_finished() and not constraint.allowed().any()
    with pytest.raises(ValueError, match="already ended"):
        constraint.advance(vocab.end_id)


def test_illegal_advance_raises_and_keeps_state(handle):
    """advance refuses a token the mask does not allow (text, end of turn too early, vision, out of range) with
    a ValueError, and the constraint carries on unchanged; a mask already returned stays as it was."""
    vocab = vocabulary_of(handle)
    constraint = constraint_for(handle, json_object())
    before = constraint.allowed().clone()
    vision = handle.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    quote = handle.tokenizer.convert_tokens_to_ids('"')
    for token in (quote, vocab.end_id, vision, vocab.vocab_size, -1):
        with pytest.raises(ValueError, match="not allowed"):
            constraint.advance(token)
    assert torch.equal(constraint.allowed(), before) and constraint.num_tokens == 0
    returned = constraint.allowed()
    constraint.advance(int(torch.nonzero(before)[0]))
    assert constraint.num_tokens == 1 and torch.equal(returned, before)  # a returned mask is never changed


def test_mask_covers_a_larger_model_vocabulary(handle):
    """A model whose embedding has more rows than the tokenizer has tokens gets masks of its size; the extra
    ids are never allowed (checked on every step of a tool-call answer)."""
    vocab = vocabulary(handle.tokenizer, len(handle.tokenizer) + 37)
    assert vocab.vocab_size == len(handle.tokenizer) + 37 and vocab is not vocabulary_of(handle)
    spec = tool_calls(random_tools(random.Random(0)))
    ids = drive(compile_grammar(vocab, spec).start(), handle.tokenizer, vocab, seed=0, max_steps=400)
    assert parse_tool_calls(handle.tokenizer.decode(ids, skip_special_tokens=True)).calls


def test_non_strict_ignores_keywords_it_cannot_enforce(handle):
    """strict=False: an unenforceable keyword (uniqueItems) is reported in warnings and ignored; the output still
    parses and validates against the schema without it."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 3}
    spec = json_schema({**schema, "uniqueItems": True}, strict=False)
    assert any("uniqueItems" in warning for warning in spec.warnings)
    vocab = vocabulary_of(handle)
    for seed in range(5):
        ids = drive(compile_grammar(vocab, spec).start(), handle.tokenizer, vocab, seed, max_steps=40)
        jsonschema.validate(json.loads(handle.tokenizer.decode(ids, skip_special_tokens=True)), schema)


def test_compiled_once_per_vocabulary_and_spec(handle):
    """Equal specs made twice share one compiled grammar; two answers from it advance independently."""
    vocab = vocabulary_of(handle)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    first = compile_grammar(vocab, json_schema(schema, strict=True))
    hits = grammar_cache().hits
    assert compile_grammar(vocab, json_schema(dict(schema), strict=True)) is first
    assert grammar_cache().hits == hits + 2  # the spec, then the compiled grammar
    one, two = first.start(), first.start()
    one.advance(int(torch.nonzero(one.allowed())[0]))
    assert one.num_tokens == 1 and two.num_tokens == 0 and not torch.equal(one.allowed(), two.allowed())
    assert vocabulary_of(handle) is vocab  # the engine's token table is built once per tokenizer


@pytest.fixture(scope="module")
def hermes_tokenizer():
    """A byte-level BPE trained on tool-call text (tokens such as ' {"' and ' []}}' span the template's literal
    text and the JSON), with <tool_call> and </tool_call> added as single tokens, as in the released Qwen
    tokenizers."""
    rng = random.Random(0)
    corpus = []
    for _ in range(200):
        args = {
            "at": [rng.randint(0, 9), rng.randint(0, 9)],
            "label": rng.choice(["ok", "a b", ""]),
            "also": [],
        }
        corpus.append(format_tool_calls([FunctionCall(rng.choice(["tap", "type_text"]), args)]))
    tokenizer = copy.deepcopy(train_tokenizer(corpus, 2000))
    tokenizer.add_tokens(
        [AddedToken(tag, special=False, normalized=False) for tag in ("<tool_call>", "</tool_call>")]
    )
    return tokenizer


def test_the_models_own_tokenization_is_allowed(hermes_tokenizer):
    """The template's text of random calls, tokenized as the model saw it in training (single tag tokens,
    tokens across the literal/JSON seams), is allowed token by token, then the end of turn."""
    parameters = {
        "type": "object",
        "properties": {
            "at": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
            "label": {"type": "string"},
            "also": {"type": "array", "maxItems": 0},
        },
        "required": ["at", "label", "also"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": n, "parameters": parameters}} for n in ("tap", "type_text")
    ]
    vocab = vocabulary(hermes_tokenizer)
    compiled = compile_grammar(vocab, tool_calls(tools, "required", parallel=True))
    assert "<[" in vocab.tag_rules  # the tags are named by their token ids
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        calls = [
            FunctionCall(
                rng.choice(["tap", "type_text"]),
                {"at": [rng.randint(0, 99)], "label": rng.choice(["ok", "x y"]), "also": []},
            )
            for _ in range(rng.randint(1, 3))
        ]
        ids = hermes_tokenizer.encode(format_tool_calls(calls), add_special_tokens=False)
        assert hermes_tokenizer.convert_tokens_to_ids("<tool_call>") in ids
        constraint = compiled.start()
        for token in [*ids, vocab.end_id]:
            assert constraint.allowed()[token], hermes_tokenizer.decode(ids[: constraint.num_tokens + 1])
            constraint.advance(token)
        assert constraint.is_finished()


def test_single_tag_tokens_under_random_logits(hermes_tokenizer):
    """With <tool_call> an added token, random answers still decode to valid calls."""
    vocab = vocabulary(hermes_tokenizer)
    spec = tool_calls(random_tools(random.Random(1)), "required")
    for seed in range(5):
        ids = drive(compile_grammar(vocab, spec).start(), hermes_tokenizer, vocab, seed, max_steps=600)
        parsed = parse_tool_calls(hermes_tokenizer.decode(ids, skip_special_tokens=True))
        assert len(parsed.calls) == 1 and not parsed.malformed


TOOL = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: json_schema({"type": "foo"}), ["not a valid JSON schema", "$.type"]),
        (lambda: json_schema({"properties": {"a": {"minimum": "one"}}}), ["not a valid JSON schema"]),
        (lambda: json_schema([1]), ["must be a JSON object"]),
        (
            lambda: json_schema({"type": "array", "uniqueItems": True}, strict=True),
            ["uniqueItems", "strict: false"],
        ),
        (lambda: json_schema({"not": {"type": "string"}}, strict=True), ["not", "strict: false"]),
        (lambda: json_schema({"type": "integer", "minimum": 5, "maximum": 1}), ["Unsatisfiable"]),
        (lambda: tool_calls([]), ["non-empty list"]),
        (lambda: tool_calls([TOOL], {"name": "type"}), ["'type'", "not in tools", "click"]),
        (lambda: tool_calls([TOOL], "auto"), ["'auto'", "parse_tool_calls"]),
        (lambda: tool_calls([TOOL, TOOL]), ["twice"]),
        (lambda: tool_calls([{"type": "function", "function": {"name": "a b"}}]), ["tools[0].function.name"]),
        (
            lambda: tool_calls([{"name": "f", "parameters": {"type": "string"}}]),
            ["tools[0].function.parameters"],
        ),
        (
            lambda: tool_calls(
                [TOOL, {"name": "g", "parameters": {"type": "object", "if": {}}, "strict": True}]
            ),
            ["tools[1].function.parameters", "if"],
        ),
    ],
)
def test_bad_specs_raise_saying_what_to_change(make, words):
    """Invalid or unenforceable schemas and tool lists raise GrammarError (a ValueError the server answers
    with a 400) whose message names the field and the fix."""
    with pytest.raises(GrammarError) as caught:
        make()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, MmkvError)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_a_pydantic_schema_is_enforced_and_ends(handle):
    """A pydantic model's schema, as agent frameworks send it ($defs, $ref, anyOf with null, titles, defaults,
    no additionalProperties): the call validates and ends within the bound of its declared properties."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=0, le=1920)
        y: int = Field(ge=0, le=1080)

    class Click(BaseModel):
        at: Point
        button: Literal["left", "right"] = "left"
        note: str | None = Field(default=None, max_length=8)
        also: list[Point] = Field(default_factory=list, max_length=2)

    schema = Click.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    spec = tool_calls(
        [{"type": "function", "function": {"name": "click", "parameters": schema}}], {"name": "click"}
    )
    vocab, bound = vocabulary_of(handle), 300  # the longest call: about 170 bytes
    for seed in range(NUM_CASES):
        constraint = compile_grammar(vocab, spec).start()
        ids = drive(constraint, handle.tokenizer, vocab, seed, max_steps=bound, is_complete=is_hermes)
        assert constraint.is_finished()
        (call,) = parse_tool_calls(handle.tokenizer.decode(ids, skip_special_tokens=True)).calls
        Click.model_validate(call.arguments)
        jsonschema.validate(call.arguments, schema)


def test_a_tool_without_parameters_takes_empty_arguments(handle):
    """A function with no parameters schema (OpenAI: an empty parameter list) is called with {}."""
    constraint = constraint_for(handle, tool_calls([{"type": "function", "function": {"name": "noop"}}]))
    assert isinstance(constraint, GrammarConstraint)
    ids = drive(constraint, handle.tokenizer, vocabulary_of(handle), seed=0, max_steps=200)
    assert handle.tokenizer.decode(ids, skip_special_tokens=True) == format_tool_calls(
        [FunctionCall("noop", {})]
    )
