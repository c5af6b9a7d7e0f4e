"""JSON schemas for the grammar engine: closing objects narrows what validates, never widens it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mmkv.errors import GrammarError
from mmkv.runtime.json_schemas import JSON_FORMAT, check_schema, close_objects, json_rule

OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_objects_with_properties_are_closed_everywhere():
    """Declared-property objects get additionalProperties: false at the root, in properties, items, $defs, anyOf
    alternatives; the input is not modified."""
    schema = {
        "type": "object",
        "$defs": {"P": OBJECT},
        "properties": {
            "inner": OBJECT,
            "many": {"type": "array", "items": OBJECT},
            "either": {"anyOf": [OBJECT]},
        },
    }
    before = json.dumps(schema)
    closed = close_objects(schema)
    assert json.dumps(schema) == before
    for node in (
        closed,
        closed["$defs"]["P"],
        closed["properties"]["inner"],
        closed["properties"]["many"]["items"],
        closed["properties"]["either"]["anyOf"][0],
    ):
        assert node["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["inner"]["properties"]["a"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # a free map
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},
        {"properties": {"a": {}}, "$ref": "#/$defs/X", "$defs": {"X": {"type": "object"}}},
    ],
)
def test_objects_that_decide_extra_keys_elsewhere_stay_open(schema):
    """Free maps, explicit additionalProperties/patternProperties, allOf parts and siblings, $ref siblings: the
    root keeps whatever it had (closing them could refuse valid output)."""
    closed = close_objects(schema)
    assert closed.get("additionalProperties") == schema.get("additionalProperties")
    for part in closed.get("allOf", []):
        assert "additionalProperties" not in part


def test_closed_schemas_accept_only_what_the_original_accepts():
    """Instances valid against the closed schema are valid against the original; extra keys are refused."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": OBJECT}},
    }
    closed = close_objects(schema)
    good = {"a": 1, "b": [{"a": 2}, {}]}
    jsonschema.validate(good, closed)
    jsonschema.validate(good, schema)
    for extra in ({"a": 1, "z": 0}, {"b": [{"a": 1, "z": 0}]}):
        jsonschema.validate(extra, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, closed)


def test_json_rule_carries_the_compact_format():
    """The %json rule holds the closed schema and the compact JSON options, replacing the caller's x-guidance."""
    rule = json_rule({**OBJECT, "x-guidance": {"whitespace_flexible": True}}, lenient=True)
    assert rule.startswith("%json ")
    body = json.loads(rule.removeprefix("%json "))
    assert body["x-guidance"] == {**JSON_FORMAT, "lenient": True} and body["additionalProperties"] is False


def test_check_schema_says_what_to_change():
    """An invalid schema names the field and where; an unenforceable keyword is refused unless lenient, when
    it comes back as a warning."""
    with pytest.raises(GrammarError, match=r"tools\[0\] is not a valid JSON schema: .* \(at \$\.type\)"):
        check_schema("tools[0]", json.dumps({"type": 3}), False)
    with pytest.raises(GrammarError, match="uniqueItems.*strict: false"):
        check_schema("x", json.dumps({"type": "array", "uniqueItems": True}), False)
    assert any(
        "uniqueItems" in w
        for w in check_schema("x", json.dumps({"type": "array", "uniqueItems": True}), True)
    )
