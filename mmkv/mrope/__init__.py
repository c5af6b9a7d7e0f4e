"""M-RoPE position math: the position rule, the rotary channel layout, exact re-rotation of cached keys."""

from .layout import RotaryLayout, frequency_axes, rotary_layout_from_config
from .positions import (
    ImageSpan,
    PositionRule,
    TextSpan,
    image_positions,
    image_slots,
    llm_grid,
    sequence_positions,
    text_positions,
)
from .rotate import rerotate, rotation_tables

__all__ = [
    "ImageSpan",
    "PositionRule",
    "RotaryLayout",
    "TextSpan",
    "frequency_axes",
    "image_positions",
    "image_slots",
    "llm_grid",
    "rerotate",
    "rotary_layout_from_config",
    "rotation_tables",
    "sequence_positions",
    "text_positions",
]
