"""Named fields in text: ``"account_role: {role}"`` with ``{"role": "admin"}``, filled, with the character span
of each value kept, so that a rendered prompt can say exactly which tokens a field's value occupies."""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["FIELD_NAME", "fill_template", "validate_fields"]

FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def validate_fields(template: str, fields: Mapping[str, str]) -> dict[str, str]:
    """``fields`` as a plain dict after checking it against ``template``: every name an identifier whose
    ``{name}`` placeholder occurs exactly once, every value a non-empty string. Raises ``ValueError``/
    ``TypeError`` naming the offending field."""
    out = {}
    for name, value in fields.items():
        if not isinstance(name, str) or not FIELD_NAME.fullmatch(name):
            raise ValueError(f"field names are identifiers; got {name!r}")
        if not isinstance(value, str):
            raise TypeError(f"field {name!r}: the value must be a str, got {type(value).__name__}")
        if not value:
            raise ValueError(f"field {name!r}: the value cannot be empty (it must occupy at least one token)")
        count = template.count("{" + name + "}")
        if count != 1:
            raise ValueError(
                f"field {name!r}: the text must hold the placeholder {{{name}}} once, found {count}"
            )
        out[name] = value
    return out


def fill_template(template: str, fields: Mapping[str, str]) -> tuple[str, dict[str, tuple[int, int]]]:
    """``template`` with each ``{name}`` of ``fields`` replaced by its value (other braces are left alone),
    and the ``[begin, end)`` character span of each value in the result."""
    if not fields:
        return template, {}
    pattern = re.compile("|".join(re.escape("{" + name + "}") for name in fields))
    parts, spans, cursor, length = [], {}, 0, 0
    for match in pattern.finditer(template):
        literal = template[cursor : match.start()]
        name = match.group(0)[1:-1]
        value = fields[name]
        parts += [literal, value]
        length += len(literal)
        spans[name] = (length, length + len(value))
        length += len(value)
        cursor = match.end()
    parts.append(template[cursor:])
    return "".join(parts), spans
