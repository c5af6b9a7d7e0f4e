"""``mmkv.load``: one entry point for tiny built-in models, shipped small checkpoints, local directories and hub ids.

Every real checkpoint goes through one path: resolve a local directory (an existing path, or a hub id found in
the local Hugging Face cache or downloaded), read its config, detect the family from ``model_type``, load the
transformers class with ``from_pretrained``, and build the image-only processor from the same directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig

from ..errors import ModelNotFoundError
from .families import family_named, family_of
from .handle import ModelHandle
from .processor import VLProcessor
from .registry import ALIASES, SHIPPED, TINY, is_hub_id, resolve_alias, unknown_name_message
from .tiny import build_tiny

__all__ = ["load", "resolve_checkpoint"]

_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*", "*.model", "*.tiktoken"]


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _not_found(name: str, repo: str, cause: str) -> ModelNotFoundError:
    known = ", ".join(sorted([*TINY, *SHIPPED, *ALIASES]))
    return ModelNotFoundError(
        f"cannot load {name!r}: {repo!r} is not a local directory and is not in the local Hugging Face cache, "
        f"and it could not be downloaded ({cause}). Fix: on a machine with network run `hf download {repo} "
        f"--local-dir DIR` and copy DIR here, then pass it: --model DIR on the command line, mmkv.load('DIR') "
        f"in Python (or set HF_HOME to that cache). Without weights, try small-qwen3-vl (shipped, trained) or "
        f"tiny-qwen3-vl (random). Known names: {known}."
    )


def resolve_checkpoint(name: str) -> Path:
    """The local directory of a checkpoint: an existing path, or a hub id from the cache or the hub.

    Raises ``ModelNotFoundError`` (quickly, without retries) when neither works.
    """
    repo = resolve_alias(name)
    path = Path(repo).expanduser()
    if path.is_dir():
        return path
    if name.lower() in SHIPPED or repo.startswith((".", "/", "~")) or repo.count("/") > 1:
        raise _not_found(name, repo, "no such directory")
    if not is_hub_id(repo):  # a mistyped name, not a hub id: nothing to download
        raise ModelNotFoundError(f"cannot load {name!r}: {unknown_name_message(name)}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo, allow_patterns=_CHECKPOINT_FILES, local_files_only=True))
    except (OSError, HFValidationError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise _not_found(name, repo, "HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(repo, allow_patterns=_CHECKPOINT_FILES))
    except Exception as exc:  # connection, auth, missing repo: all mean "not available here"
        raise _not_found(name, repo, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc


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
