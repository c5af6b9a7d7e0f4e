"""Prompts: a conversation rendered by the model's own chat template, cut into pieces and laid out in position
space; named ``{field}`` placeholders and the token spans of their values."""

from .fields import FIELD_NAME, fill_template, validate_fields
from .layout import PromptPiece, layout_positions, split_prompt
from .render import RenderedPrompt, render_prompt

__all__ = [
    "FIELD_NAME",
    "PromptPiece",
    "RenderedPrompt",
    "fill_template",
    "layout_positions",
    "render_prompt",
    "split_prompt",
    "validate_fields",
]
