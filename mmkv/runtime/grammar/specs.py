"""What an answer must be: ``GrammarSpec`` s for JSON objects, JSON schemas and tool calls (built and checked,
not compiled), and the ``TokenConstraint`` protocol the decoder drives."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from llguidance import LLMatcher

from ...errors import GrammarError
from ..json_schemas import json_rule

if TYPE_CHECKING:
    pass
from .limits import (
    _KINDS,
    _TEXT_TAGS,
    ENGINE_LIMITS,
    TOOL_NAME,
    GrammarKind,
    _cached_spec,
    _checked,
)


@runtime_checkable
class TokenConstraint(Protocol):
    """Which tokens may come next in an answer; the decode loop's only view of a grammar."""

    def allowed(self) -> torch.Tensor:
        """``(vocab,)`` bool, CPU: the tokens allowed next. Does not change state."""
        ...

    def allowed_ids(self) -> torch.Tensor:
        """``(num_allowed,)`` int64, CPU, ascending: the ids ``allowed()`` marks. Does not change state."""
        ...

    def advance(self, token: int) -> None:
        """Take the chosen token (one ``allowed()`` marks); raises ``ValueError`` for any other."""
        ...

    def is_finished(self) -> bool:
        """Nothing but the end of turn can follow (or it was taken): the caller ends the answer."""
        ...


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer must be, as a Lark grammar for llguidance. Made (and validated) by ``json_object``,
    ``json_schema`` or ``tool_calls``; equal specs share one compiled grammar."""

    kind: GrammarKind  # which constructor made it
    lark: str  # the grammar; a tool-call grammar uses the rules tool_call_open / tool_call_close, left undefined
    label: str = field(default="", compare=False)  # for messages and logs: "tool_calls(named: wait)"
    warnings: tuple[str, ...] = field(default=(), compare=False)  # schema keywords ignored (not strict)
    # the specs it joins (tool_calls_or), compiled and probed each on its own first: the joined grammar starts
    # with a choice, so it has no forced tokens to probe an engine limit of a branch through
    parts: tuple[GrammarSpec, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if not self.lark.startswith("start:"):
            raise ValueError(f"a grammar spec's Lark text starts with its start rule, got {self.lark[:40]!r}")


def _validated(
    kind: GrammarKind, lark: str, label: str, warnings: tuple[str, ...], parts: tuple[GrammarSpec, ...] = ()
) -> GrammarSpec:
    """The spec, after the whole grammar passes the engine's check (its parts were checked one by one)."""
    checked = lark + ("\n" + _TEXT_TAGS if kind == "tool_calls" else "")
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        LLMatcher.grammar_from_lark(checked), None, limits=ENGINE_LIMITS
    )
    if is_error:
        reason = messages[0].strip().splitlines()[0][:300]
        raise GrammarError(f"{label}: the grammar engine refused it: {reason}")
    return GrammarSpec(kind, lark, label, warnings, parts)


def json_object(deadline: float | None = None) -> GrammarSpec:
    """Any JSON object (OpenAI ``response_format: {"type": "json_object"}``), its keys unique in each object."""
    lark = "start: " + json_rule({"type": "object"}, False)
    return _cached_spec(
        ("json_object",), deadline, lambda: _validated("json_object", lark, "json_object", ())
    )


def json_schema(schema: dict[str, Any], strict: bool = False, deadline: float | None = None) -> GrammarSpec:
    """JSON valid against ``schema`` (OpenAI ``response_format: json_schema``). ``strict``: refuse a keyword the
    engine cannot enforce (``uniqueItems``, ``if``/``then``, ``not``, ...); not strict: ignore it (listed in
    ``warnings``), so the output always parses but may break that keyword. Either way refused: a schema over
    ``json_schemas``' bounds, and one no finite value satisfies. Cached by its JSON text; the checks wait for the
    heavy turn until ``deadline``. Raises ``GrammarError`` (``GrammarTimeoutError`` past the deadline)."""
    where = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON object, got {type(schema).__name__}")
    text = json.dumps(schema)

    def make() -> GrammarSpec:
        warnings = tuple(f"{where}: {w}" for w in _checked(where, text, not strict))
        label = "json_schema(strict)" if strict else "json_schema"
        return _validated("json_schema", "start: " + json_rule(schema, not strict), label, warnings)

    return _cached_spec(("json_schema", text, bool(strict)), deadline, make)


def _function(index: int, tool: Any) -> tuple[str, dict[str, Any], bool]:
    """(name, parameters schema, strict) of ``tools[index]``, an OpenAI tool or a bare function."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise GrammarError(
            f"{where} must be an object like {{'type': 'function', 'function': {{'name': ...}}}}"
        )
    if tool.get("type", "function") != "function":
        raise GrammarError(f"{where}.type must be 'function', got {tool.get('type')!r}")
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise GrammarError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    parameters = function.get("parameters")
    if parameters is None:  # OpenAI: no parameters is an empty parameter list
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise GrammarError(f"{where}.function.parameters must be a JSON schema of type 'object' ({name!r})")
    return name, {"type": "object", **parameters}, bool(function.get("strict", False))


def _chosen_name(mode: Any, names: list[str]) -> str | None:
    """The one function a named tool choice allows, or None for ``required`` (any listed)."""
    if mode == "required":
        return None
    if isinstance(mode, str):
        raise GrammarError(
            f"tool_choice {mode!r} does not constrain decoding: use 'required' or {{'name': ...}} "
            "(parse free output with mmkv.toolcalls.parse_tool_calls)"
        )
    inner = mode.get("function", mode) if isinstance(mode, dict) else None
    name = inner.get("name") if isinstance(inner, dict) else None
    if not isinstance(name, str):
        raise GrammarError(f"tool_choice must be 'required' or {{'name': <function name>}}, got {mode!r}")
    if name not in names:
        raise GrammarError(f"tool_choice names {name!r}, which is not in tools ({', '.join(names)}); list it")
    return name


def tool_calls(
    tools: list[dict[str, Any]], mode: Any = "required", parallel: bool = False, deadline: float | None = None
) -> GrammarSpec:
    """The answer IS hermes tool call(s) as the Qwen templates render them (``toolcalls.format_tool_calls``):
    ``<tool_call>\\n{"name": "<listed name>", "arguments": <valid JSON>}\\n</tool_call>``, one, or with
    ``parallel`` (and ``required``) one or more joined by newlines. ``mode``: ``"required"`` (any listed function)
    or ``{"name": ...}`` (exactly one call of that one, whatever ``parallel``, as OpenAI and vLLM answer; OpenAI's
    ``{"type": "function", "function": {"name": ...}}`` too). A function's ``strict`` decides, as in
    ``json_schema``, whether unenforceable keywords are refused or ignored; every listed function's parameters
    are checked whatever the mode (the same list gets the same verdict). Cached by its JSON text; the checks wait
    for the heavy turn until ``deadline``. Raises ``GrammarError`` for an empty list, a duplicate or unlisted
    name, an invalid parameters schema (``GrammarTimeoutError`` past the deadline)."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise GrammarError(
            "tools must be a non-empty list of functions when tool_choice is 'required' or named"
        )
    functions = [_function(i, tool) for i, tool in enumerate(tools)]
    names = [name for name, _, _ in functions]
    if len(set(names)) < len(names):
        raise GrammarError(f"tools lists a function name twice ({', '.join(names)}); names must be unique")
    chosen = _chosen_name(mode, names)
    parallel = bool(parallel) and chosen is None
    texts = [json.dumps(parameters) for _, parameters, _ in functions]

    def make() -> GrammarSpec:
        rules, alternatives, warnings = [], [], []
        for i, ((name, parameters, strict), text) in enumerate(zip(functions, texts, strict=True)):
            where = f"tools[{i}].function.parameters"
            warnings += [f"{where}: {w}" for w in _checked(where, text, not strict)]
            if chosen is not None and name != chosen:
                continue
            head = json.dumps(f'\n{{"name": "{name}", "arguments": ')
            rules.append(f'call_{i}: tool_call_open {head} args_{i} "}}\\n" tool_call_close')
            rules.append(f"args_{i}: {json_rule(parameters, not strict)}")
            alternatives.append(f"call_{i}")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        lark = "\n".join([start, "call: " + " | ".join(alternatives), *rules]) + "\n"
        listed = names if chosen is None else [chosen]
        label = f"tool_calls({'required' if chosen is None else 'named'}: {', '.join(listed)})"
        return _validated("tool_calls", lark, label + (" parallel" if parallel else ""), tuple(warnings))

    strictness = json.dumps([strict for _, _, strict in functions])
    key = ("tool_calls", json.dumps(names), strictness, *texts, chosen, parallel)
    return _cached_spec(key, deadline, make)


def tool_calls_or(
    tools_spec: GrammarSpec, answer_spec: GrammarSpec, deadline: float | None = None
) -> GrammarSpec:
    """An answer that is either the tool call(s) ``tools_spec`` allows or what ``answer_spec`` (a JSON object or
    schema) allows: ``tool_choice: "auto"`` with a ``response_format``, where the model may call a tool or answer
    in the format. Raises ``GrammarError`` (as its parts would)."""
    if tools_spec.kind != "tool_calls" or answer_spec.kind == "tool_calls":
        raise ValueError("tool_calls_or takes a tool_calls spec and a json spec")

    def make() -> GrammarSpec:
        tools_head, *tools_rules = tools_spec.lark.strip().split("\n")
        answer_head, *answer_rules = answer_spec.lark.strip().split("\n")
        lark = "\n".join([
            "start: calls | answer", "calls:" + tools_head[len("start:"):], "answer:" + answer_head[len("start:"):],
            *tools_rules, *answer_rules,
        ]) + "\n"  # fmt: skip
        label = f"{tools_spec.label} or {answer_spec.label}"
        warnings = tools_spec.warnings + answer_spec.warnings
        return _validated("tool_calls", lark, label, warnings, (tools_spec, answer_spec))

    return _cached_spec(("tool_calls_or", tools_spec.lark, answer_spec.lark), deadline, make)
