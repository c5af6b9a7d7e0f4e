"""JSON schemas as the grammar engine (llguidance) takes them: checked, closed, and written compact.

Three steps under ``grammar.py``'s constructors: ``check_schema`` (is it a valid schema, can llguidance
enforce it; a ``GrammarError`` says which field and what to change), ``close_objects`` (objects that declare
properties admit no others unless the schema says so) and ``json_rule`` (the ``%json`` rule of a Lark grammar,
with ``JSON_FORMAT``: ``json.dumps``' separators, no other whitespace). Example::

    close_objects({"type": "object", "properties": {"a": {"type": "integer"}}})
    {'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'additionalProperties': False}
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
from llguidance import LLMatcher

from ..errors import GrammarError

__all__ = ["JSON_FORMAT", "check_schema", "close_objects", "json_rule"]

# llguidance's JSON options for every schema: json.dumps' separators, no flexible whitespace
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "unevaluatedItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "additionalProperties", "$defs", "definitions")  # (a map of schemas, or one)
# an object with one of these decides its extra keys itself, or shares the decision with other schemas
_OPEN_KEYS = frozenset(
    ["additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref"]
)


def close_objects(node: Any, in_all_of: bool = False) -> Any:
    """A copy of a schema whose objects with declared ``properties`` admit no others (``additionalProperties:
    false``) unless the schema says otherwise, as xgrammar's default ``strict_mode`` (vLLM, SGLang) and OpenAI's
    strict mode: every output still validates against the original, and an object can end (random weights never
    stop inventing keys). Left open: objects without properties (free maps) and every object whose extra keys
    another keyword decides (``allOf`` parts, siblings of ``anyOf``/``oneOf``/``allOf``/``$ref``). ``in_all_of``:
    ``node`` is a part of an ``allOf`` (the recursion's own flag)."""
    if isinstance(node, list):
        return [close_objects(item, in_all_of) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: close_objects(value, key == "allOf") if key in _SUBSCHEMAS else value
        for key, value in node.items()
    }
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            is_map = key != "additionalProperties"
            out[key] = (
                {k: close_objects(v) for k, v in node[key].items()} if is_map else close_objects(node[key])
            )
    if "properties" in node and not in_all_of and not _OPEN_KEYS & node.keys():
        out["additionalProperties"] = False
    return out


def json_rule(schema: dict[str, Any], lenient: bool) -> str:
    """``%json {...}`` for an llguidance Lark grammar: the schema, closed, with ``JSON_FORMAT`` and ``lenient``
    (replacing any ``x-guidance`` of its own)."""
    return "%json " + json.dumps({**close_objects(schema), "x-guidance": {**JSON_FORMAT, "lenient": lenient}})


@functools.lru_cache(maxsize=256)
def check_schema(where: str, schema_json: str, lenient: bool) -> tuple[str, ...]:
    """Raise a ``GrammarError`` if the schema is invalid or (unless lenient) uses a keyword llguidance cannot
    enforce; else the engine's warnings (the keywords it will ignore). Cached: a request repeats its schema."""
    schema = json.loads(schema_json)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as e:
        raise GrammarError(
            f"{where} is not a valid JSON schema: {e.message} (at {e.json_path}); fix it"
        ) from None
    grammar = LLMatcher.grammar_from_json_schema(
        close_objects(schema), defaults={**JSON_FORMAT, "lenient": lenient}
    )
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        reason = messages[0].strip().splitlines()[0]
        hint = (
            "remove them, or send strict: false to have them ignored"
            if "Unimplemented" in reason or "Unknown format" in reason
            else "change the schema"
        )
        raise GrammarError(f"{where} cannot be enforced: {reason}; {hint}")
    return tuple(messages)
