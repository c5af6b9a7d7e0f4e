"""The model families mmkv caches, one module each, and the registry the rest of mmkv asks.

``FAMILIES`` maps every config ``model_type`` mmkv loads to its ``Family`` (``base.py``); ``family_of`` is the
one lookup, with the error a user sees for anything else. Importing this package loads neither torch nor
transformers. Adding a family: a new module here defining its ``Family`` record(s), one line in ``_ALL``
below, and its tests (README, "Adding a model family").
"""

from __future__ import annotations

from ...errors import UnsupportedModelError
from .base import Family, ToolFormat, VisionTokens
from .glm4v import GLM4V, GLM4V_MOE
from .qwen_vl import QWEN2_5_VL, QWEN2_VL, QWEN3_VL

__all__ = ["FAMILIES", "Family", "ToolFormat", "VisionTokens", "family_named", "family_of"]

_ALL: tuple[Family, ...] = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, GLM4V, GLM4V_MOE)

# config model_type -> family (a family may serve several, e.g. Qwen3-VL dense and MoE)
FAMILIES: dict[str, Family] = {model_type: f for f in _ALL for model_type in f.model_classes}


def family_named(name: str) -> Family:
    """The family whose key is ``name`` (``Family.name``, e.g. ``"qwen3_vl"``); ``KeyError`` otherwise."""
    for family in _ALL:
        if family.name == name:
            return family
    raise KeyError(f"no model family {name!r}; known: {', '.join(f.name for f in _ALL)}")


def family_of(model_type: str | None) -> Family:
    """The family of a config's ``model_type``. Raises ``UnsupportedModelError`` naming what is supported."""
    if model_type not in FAMILIES:
        labels = ", ".join(sorted({f.label for f in _ALL}))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; mmkv caches {labels} checkpoints "
            f"({', '.join(FAMILIES)})"
        )
    return FAMILIES[model_type]
