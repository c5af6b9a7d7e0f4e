"""Names ``mmkv.load`` understands: aliases of released checkpoints and built-in tiny models (each family's,
``mmkv.model.families``), shipped small models.

Anything else is taken as a local directory or a Hugging Face hub id.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from .families import FAMILIES

__all__ = [
    "ALIASES",
    "SHIPPED_DIR",
    "SHIPPED",
    "TINY",
    "close_names",
    "is_hub_id",
    "known_names",
    "resolve_alias",
    "unknown_name_message",
]

# alias -> hub id of a released checkpoint, and tiny random-weight model name -> family key: each family's own
_FAMILY_LIST = list(dict.fromkeys(FAMILIES.values()))
ALIASES: dict[str, str] = {alias: hub for f in _FAMILY_LIST for alias, hub in f.aliases.items()}
TINY: dict[str, str] = {f.tiny_name: f.name for f in _FAMILY_LIST if f.tiny_name}

# small trained checkpoints shipped in the repository (see evals/ and training/)
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "checkpoints"
SHIPPED: dict[str, str] = {"small-qwen2.5-vl": "small-qwen2.5-vl", "small-qwen3-vl": "small-qwen3-vl"}


def resolve_alias(name: str) -> str:
    """The hub id or local path an alias stands for; other names come back unchanged."""
    key = name.lower()
    if key in ALIASES:
        return ALIASES[key]
    if key in SHIPPED:
        return str(SHIPPED_DIR / SHIPPED[key])
    return name


_HUB_ID = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+"
)  # org/name, as the hub spells repository ids


def known_names() -> list[str]:
    """Every name ``mmkv.load`` knows without a path or a hub id (tiny, shipped and alias names), sorted."""
    return sorted([*TINY, *SHIPPED, *ALIASES])


def is_hub_id(name: str) -> bool:
    """Whether ``name`` looks like a Hugging Face hub id, ``org/name``.

    >>> is_hub_id("Qwen/Qwen3-VL-8B-Instruct"), is_hub_id("qwen3-vl-9b"), is_hub_id("./ckpt/x"), is_hub_id("a/b/c")
    (True, False, False, False)
    """
    return _HUB_ID.fullmatch(name) is not None


def close_names(name: str) -> list[str]:
    """Up to three known names closest to ``name`` (``difflib``), closest first.

    >>> close_names("qwen3-vl-9b"), close_names("small-qwen3vl"), close_names("llama")
    (['qwen3-vl-8b', 'qwen3-vl-4b', 'qwen3-vl-2b'], ['small-qwen3-vl', 'small-qwen2.5-vl', 'tiny-qwen3-vl'], [])
    """
    return difflib.get_close_matches(name.lower(), known_names(), n=3, cutoff=0.6)


def unknown_name_message(name: str) -> str:
    """What to say about ``name`` when it is no known name, no hub id and no directory: the closest known
    names, and all of them. No download advice: a name that is not ``org/name`` has nothing to download."""
    close = close_names(name)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return (
        f"unknown model {name!r}: not a known name, a local directory or a Hugging Face id (org/name).{hint} "
        f"Known names: {', '.join(known_names())}."
    )
