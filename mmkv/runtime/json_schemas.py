"""JSON schemas as the grammar engine (llguidance) takes them: checked, closed, and written compact.

Three steps under ``grammar.py``'s constructors: ``check_schema`` (is it within the bounds, a valid schema,
satisfiable by a finite value, can llguidance enforce it; a ``GrammarError`` says which field and what to
change), ``close_objects`` (objects that declare properties admit no others unless the schema says so) and
``json_rule`` (the ``%json`` rule of a Lark grammar, with ``JSON_FORMAT``: ``json.dumps``' separators, no other
whitespace). Example::

    close_objects({"type": "object", "properties": {"a": {"type": "integer"}}})
    {'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'additionalProperties': False}
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from llguidance import LLMatcher

from ..errors import GrammarError

__all__ = ["JSON_FORMAT", "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES", "check_schema", "close_objects", "json_rule",
           "unsatisfiable_at"]  # fmt: skip

# llguidance's JSON options for every schema: json.dumps' separators, no flexible whitespace
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "unevaluatedItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "additionalProperties", "$defs", "definitions")  # (a map of schemas, or one)
# bounds on one schema, checked before anything walks it recursively: the metaschema check costs about 0.3 ms of
# pure Python (holding the GIL) per object node, so 4,096 nodes stay near a second on a slow core
MAX_SCHEMA_NODES = 4096  # objects and arrays in the schema, at every depth
MAX_SCHEMA_DEPTH = 64  # nesting of objects and arrays (the server's request bound is the same)
# the subschemas a value may have to satisfy: (keyword, how it holds them)
_VALUE_SCHEMAS = (("properties", "map"), ("patternProperties", "map"), ("additionalProperties", "one"),
                  ("items", "one_or_list"), ("prefixItems", "list"), ("additionalItems", "one"),
                  ("anyOf", "list"), ("oneOf", "list"), ("allOf", "list"))  # fmt: skip
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
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


def check_schema(where: str, schema_json: str, lenient: bool) -> tuple[str, ...]:
    """Raise a ``GrammarError`` if the schema is over the bounds (``MAX_SCHEMA_NODES``, ``MAX_SCHEMA_DEPTH``),
    invalid, not satisfiable by any finite value (``unsatisfiable_at``) or (unless lenient) uses a keyword
    llguidance cannot enforce; else the engine's warnings (the keywords it will ignore). Not cached here: the
    spec constructors in ``grammar.py`` cache whole specs."""
    schema = json.loads(schema_json)
    _check_bounds(where, schema)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as e:
        raise GrammarError(
            f"{where} is not a valid JSON schema: {e.message[:300]} (at {e.json_path}); fix it"
        ) from None
    closed = close_objects(schema)
    if (path := unsatisfiable_at(closed)) is not None:
        raise GrammarError(
            f"{where} cannot be enforced: no finite JSON value satisfies its subschema at {path} (a $ref cycle "
            "with no way out, or a required property or item that can never be written); give the recursion "
            "an end (an optional property, an anyOf branch without the $ref, minItems 0)"
        )
    grammar = LLMatcher.grammar_from_json_schema(closed, defaults={**JSON_FORMAT, "lenient": lenient})
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        reason = messages[0].strip().splitlines()[0][:300]
        hint = (
            "remove them, or send strict: false to have them ignored"
            if "Unimplemented" in reason or "Unknown format" in reason
            else "change the schema"
        )
        raise GrammarError(f"{where} cannot be enforced: {reason}; {hint}")
    return tuple(messages)


def _check_bounds(where: str, schema: Any) -> None:
    """Raise a ``GrammarError`` if ``schema`` holds more than ``MAX_SCHEMA_NODES`` objects and arrays or nests
    deeper than ``MAX_SCHEMA_DEPTH`` (walked without recursion, so any input is safe to check)."""
    num_nodes, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        num_nodes += 1
        if num_nodes > MAX_SCHEMA_NODES or depth > MAX_SCHEMA_DEPTH:
            bound = (
                f"more than {MAX_SCHEMA_NODES:,} objects and arrays"
                if num_nodes > MAX_SCHEMA_NODES
                else f"objects and arrays nested deeper than {MAX_SCHEMA_DEPTH}"
            )
            raise GrammarError(f"{where} cannot be enforced: it holds {bound}; send a smaller schema")
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def unsatisfiable_at(schema: Any) -> str | None:
    """The path (``$``, ``$.properties.a``, ``$.$defs.n``) of the first subschema that no finite JSON value
    satisfies, among those a value can reach (properties, items, combinators, local ``$ref`` targets; the
    ``false`` schema, which forbids on purpose, is never reported), or None. llguidance does not prune such a
    branch: it lets the answer enter it and then finds no way out, so the answer never ends (or the engine
    stops mid-answer). Decided as the productive symbols of a grammar: each subschema is an AND (a ``$ref``, an
    ``allOf``, the required properties / items of a type) or an OR (``anyOf``, ``oneOf``, the allowed types) of
    others, and truth propagates from the leaves (scalar types, ``const``, ``enum``). Linear in the schema's size;
    a remote or unresolvable ``$ref`` counts as satisfiable (the engine decides). Examples::

        unsatisfiable_at({"$ref": "#"})                                        # '$'
        unsatisfiable_at({"properties": {"a": {"$ref": "#/properties/a"}}})   # '$.properties.a'
        unsatisfiable_at({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                          "required": ["next"]}}, "$ref": "#/$defs/n"})       # '$'
        unsatisfiable_at({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                          "$ref": "#/$defs/n"})                               # None (next is optional)
    """
    is_and: list[bool] = []  # per gate: an AND of its children (none: true), or an OR (none: false)
    children: list[list[int]] = []  # per gate: the gates it combines
    by_node: dict[int, int] = {}  # id() of a dict subschema -> its gate
    paths: list[tuple[int, str]] = []  # (gate, path) of every dict subschema reached, in walk order
    # (gate, pointer) of each $ref, resolved after the walk (no recursion through references)
    refs: list[tuple[int, str]] = []

    def gate(kind: bool, parts: list[int]) -> int:
        is_and.append(kind)
        children.append(parts)
        return len(is_and) - 1

    true, false = gate(True, []), gate(False, [])

    def visit(node: Any, path: str) -> int:
        if node is False:
            return false
        if not isinstance(node, dict):
            return true
        if id(node) in by_node:
            return by_node[id(node)]
        own = by_node[id(node)] = gate(True, [])
        paths.append((own, path))
        parts = children[own]
        if isinstance(node.get("$ref"), str):
            ref = gate(True, [])
            refs.append((ref, node["$ref"]))
            parts.append(ref)
        subs: dict[str, Any] = {}  # every subschema a value may meet, by its path
        for key, form in _VALUE_SCHEMAS:
            value = node.get(key)
            if form == "map" and isinstance(value, dict):
                subs.update({f"{path}.{key}.{name}": sub for name, sub in value.items()})
            elif isinstance(value, list) and form in ("list", "one_or_list"):
                subs.update({f"{path}.{key}[{i}]": sub for i, sub in enumerate(value)})
            elif value is not None and form in ("one", "one_or_list"):
                subs[f"{path}.{key}"] = value
        sub_gates = {where: visit(sub, where) for where, sub in subs.items()}
        parts += [sub_gates[f"{path}.allOf[{i}]"] for i in range(len(_list(node, "allOf")))]
        for key in ("anyOf", "oneOf"):
            if _list(node, key):
                parts.append(gate(False, [sub_gates[f"{path}.{key}[{i}]"] for i in range(len(node[key]))]))
        if isinstance(node.get("enum"), list) and not node["enum"]:
            parts.append(false)
        elif "const" not in node and "enum" not in node:
            types = [_type_gate(node, t, path, sub_gates, gate, true) for t in _types(node)]
            parts.append(gate(False, types))
        return own

    root = visit(schema, "$")
    while refs:  # (visiting a target may add refs of its own)
        ref, pointer = refs.pop()
        target, where = _resolve(schema, pointer)
        children[ref].append(true if target is None else visit(target, where))
    return _first_false(is_and, children, paths, root)


def _list(node: dict, key: str) -> list:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _types(node: dict) -> tuple[str, ...]:
    kind = node.get("type")
    if isinstance(kind, str):
        return (kind,)
    return tuple(t for t in kind if isinstance(t, str)) if isinstance(kind, list) else _TYPES


def _type_gate(node: dict, kind: str, path: str, sub_gates: dict[str, int], gate, true: int) -> int:
    """The gate of ``node``'s values of type ``kind``: an object needs each required property, an array each
    of its first ``minItems`` items; a scalar is always writable."""
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        needed = []
        for name in _list(node, "required"):
            if name in properties:
                needed.append(sub_gates[f"{path}.properties.{name}"])
            elif "patternProperties" not in node and "additionalProperties" in node:
                needed.append(sub_gates[f"{path}.additionalProperties"])
        return gate(True, needed)
    if kind == "array":
        num_items = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
        prefix_key = "prefixItems" if "prefixItems" in node else "items"
        prefix = _list(node, prefix_key)
        needed = [sub_gates[f"{path}.{prefix_key}[{i}]"] for i in range(min(num_items, len(prefix)))]
        rest = "additionalItems" if prefix_key == "items" and prefix else "items"
        if num_items > len(prefix) and f"{path}.{rest}" in sub_gates:
            needed.append(sub_gates[f"{path}.{rest}"])
        return gate(True, needed)
    return true


def _resolve(schema: Any, pointer: str) -> tuple[Any, str]:
    """The subschema a local ``$ref`` names (``#``, ``#/$defs/a``, JSON-pointer escapes) and its path; (None, "")
    for a remote, anchor-style or dangling one."""
    if pointer != "#" and not pointer.startswith("#/"):
        return None, ""
    node, path = schema, "$"
    for part in pointer[2:].split("/") if pointer != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node, path = node[part], f"{path}.{part}"
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node, path = node[int(part)], f"{path}[{part}]"
        else:
            return None, ""
    return node, path


def _first_false(is_and: list[bool], children: list[list[int]], paths: list[tuple[int, str]], root: int):
    """Propagate truth from the leaves (an AND is true once all its children are, an OR once one is); the path of
    the first subschema left false, the root first."""
    parents: list[list[int]] = [[] for _ in is_and]
    waiting = [len(set(parts)) if kind else 1 for kind, parts in zip(is_and, children, strict=True)]
    for g, parts in enumerate(children):
        for child in set(parts):
            parents[child].append(g)
    is_true = [False] * len(is_and)
    ready = [g for g, kind in enumerate(is_and) if kind and not children[g]]
    while ready:
        g = ready.pop()
        if is_true[g]:
            continue
        is_true[g] = True
        for parent in parents[g]:
            waiting[parent] -= 1
            if waiting[parent] <= 0 and not is_true[parent]:
                ready.append(parent)
    if not is_true[root]:
        return "$"
    return next((path for g, path in paths if not is_true[g]), None)
