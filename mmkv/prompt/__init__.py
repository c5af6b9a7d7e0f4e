"""Prompts: a conversation rendered by the model's own chat template, cut into pieces and laid out in position
space, with the token spans of its text items and field values."""

from .blocks import LayoutBuilder, full_layout, lay_out
from .layout import PromptLayout, PromptPiece, SegmentAnchor, layout_positions, split_prompt
from .render import RenderedPrompt, render_prompt

__all__ = [
    "LayoutBuilder",
    "PromptLayout",
    "PromptPiece",
    "RenderedPrompt",
    "SegmentAnchor",
    "full_layout",
    "lay_out",
    "layout_positions",
    "render_prompt",
    "split_prompt",
]
