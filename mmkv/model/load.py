"""``mmkv.load``: one entry point for tiny built-in models, shipped small checkpoints, local directories and hub ids.

Every real checkpoint goes through one path: resolve a local directory (an existing path, or a hub id found in
the local Hugging Face cache or downloaded), read its config, detect the family from ``model_type``, load the
transformers class with ``from_pretrained``, and build the image-only processor from the same directory.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig

from .checkpoint import resolve_checkpoint
from .families import family_named, family_of
from .handle import ModelHandle
from .processor import VLProcessor
from .registry import TINY
from .tiny import build_tiny

__all__ = ["load"]


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(
    name_or_path: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> ModelHandle:
    """Load a model and return its ``ModelHandle``.

    ``name_or_path``: a tiny model such as ``"tiny-qwen3-vl"`` or ``"tiny-glm-4.1v"`` (random weights, built in
    memory; ``TINY``),
    ``"small-qwen2.5-vl"`` / ``"small-qwen3-vl"`` (shipped trained checkpoints), an alias such as
    ``"qwen3-vl-8b"``, a hub id, or a local checkpoint directory.
    ``device``: default CUDA when available, else CPU. ``dtype``: default float32 on the CPU and the
    checkpoint's own dtype (bfloat16 for the released models) on an accelerator.

    Raises ``ModelNotFoundError`` when the checkpoint is absent and cannot be fetched, and
    ``UnsupportedModelError`` for an architecture no family in ``mmkv.model.families`` serves.
    """
    name = os.fspath(name_or_path)
    device = torch.device(device) if device is not None else _default_device()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if name.lower() in TINY:
        family = family_named(TINY[name.lower()])
        model, processor = build_tiny(family.name)
        model = model.to(device=device, dtype=dtype or torch.float32)
        return ModelHandle.from_parts(name, model, processor, family)

    directory = resolve_checkpoint(name)
    config = AutoConfig.from_pretrained(directory)
    family = family_of(getattr(config, "model_type", None))
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else (getattr(config, "dtype", None) or torch.bfloat16)
    model_class = family.model_class(config.model_type)
    model = model_class.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    processor = VLProcessor.from_pretrained(directory, family)
    return ModelHandle.from_parts(name, model, processor, family)
