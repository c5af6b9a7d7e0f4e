"""Where a checkpoint's files are: ``resolve_checkpoint`` turns a name ``mmkv.load`` takes into a local directory,
importing neither torch nor transformers, so the ``mmkv`` command can say a checkpoint is missing before either
loads (``mmkv serve --model qwen3-vl-8b`` on a machine without it answers in about a second, not after ~5 s of
imports).

>>> resolve_checkpoint("small-qwen3-vl").name
'small-qwen3-vl'
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotFoundError
from .registry import ALIASES, SHIPPED, TINY, is_hub_id, resolve_alias, unknown_name_message

__all__ = ["resolve_checkpoint"]

_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*", "*.model", "*.tiktoken"]


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
    """The local directory of a checkpoint: an existing path, or a hub id from the cache or the hub (downloaded
    then, as ``mmkv.load`` would). Tiny models have none (they are built in memory): a ``ValueError``.

    Raises ``ModelNotFoundError`` (quickly, without retries) when neither works. Writes nothing but what a hub
    download writes into the Hugging Face cache.
    """
    if name.lower() in TINY:
        raise ValueError(f"{name!r} is a tiny model built in memory: it has no checkpoint directory")
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
