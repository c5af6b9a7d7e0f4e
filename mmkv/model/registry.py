"""Names ``mmkv.load`` understands: aliases of released checkpoints, built-in tiny models, shipped small models.

Anything else is taken as a local directory or a Hugging Face hub id.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ALIASES", "SHIPPED_DIR", "SHIPPED", "TINY", "resolve_alias"]

# alias -> hub id of the released instruct checkpoint
ALIASES: dict[str, str] = {
    "qwen2-vl-2b": "Qwen/Qwen2-VL-2B-Instruct",
    "qwen2-vl-7b": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen2.5-vl-32b": "Qwen/Qwen2.5-VL-32B-Instruct",
    "qwen2.5-vl-72b": "Qwen/Qwen2.5-VL-72B-Instruct",
    "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
    "qwen3-vl-4b": "Qwen/Qwen3-VL-4B-Instruct",
    "qwen3-vl-8b": "Qwen/Qwen3-VL-8B-Instruct",
    "qwen3-vl-32b": "Qwen/Qwen3-VL-32B-Instruct",
    "qwen3-vl-30b-a3b": "Qwen/Qwen3-VL-30B-A3B-Instruct",
}

# tiny random-weight models built in memory -> family
TINY: dict[str, str] = {"tiny-qwen2.5-vl": "qwen2_5_vl", "tiny-qwen3-vl": "qwen3_vl"}

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
