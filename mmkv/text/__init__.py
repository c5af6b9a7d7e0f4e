"""Text on the same segment machinery as images: named fields edited in place (five strategies) and
precompiled text segments spliced anywhere."""

from ..fields import fill_template, validate_fields
from ..policy import RANKINGS
from .compose import TextSegment, canonical_preamble, precompile
from .edit import STRATEGIES, EditReport, edit_field
from .erratum import DEFAULT_ERRATUM, erratum_line

__all__ = [
    "DEFAULT_ERRATUM",
    "RANKINGS",
    "STRATEGIES",
    "EditReport",
    "TextSegment",
    "canonical_preamble",
    "edit_field",
    "erratum_line",
    "fill_template",
    "precompile",
    "validate_fields",
]
