"""The erratum line: how a changed field is announced when the context before it is left untouched."""

from __future__ import annotations

__all__ = ["DEFAULT_ERRATUM", "erratum_line"]

DEFAULT_ERRATUM = "[STATE UPDATE] {field} has just changed to {value}; this overrides any earlier value. Apply the current value."


def erratum_line(field: str, value: str, template: str = DEFAULT_ERRATUM) -> str:
    """``template`` with ``{field}`` and ``{value}`` filled in (other braces are left alone)."""
    return template.replace("{field}", field).replace("{value}", value)
