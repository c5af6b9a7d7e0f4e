"""resolve_checkpoint: a name to a local directory, with neither torch nor transformers imported, and every
way a name can fail to be one a ``ModelNotFoundError`` (or, for a tiny model, a ``ValueError``) that says why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmkv.errors import ModelNotFoundError
from mmkv.model.checkpoint import resolve_checkpoint
from mmkv.model.registry import SHIPPED_DIR, TINY


def test_a_shipped_name_and_a_directory_resolve_to_themselves(tmp_path):
    assert resolve_checkpoint("small-qwen3-vl") == SHIPPED_DIR / "small-qwen3-vl"
    assert resolve_checkpoint("SMALL-qwen3-vl") == SHIPPED_DIR / "small-qwen3-vl"
    assert resolve_checkpoint(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_tiny_model_has_no_directory(name):
    with pytest.raises(ValueError, match="built in memory"):
        resolve_checkpoint(name)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("/no/such/dir", "no such directory"),
        ("./no/such", "no such directory"),
        ("a/b/c", "no such directory"),
        ("qwen3-vl-9b", "Did you mean qwen3-vl-8b"),
        ("no-such-model", "Known names"),
    ],
)
def test_what_is_not_a_checkpoint_says_why(name, words):
    with pytest.raises(ModelNotFoundError, match=words):
        resolve_checkpoint(name)


def test_an_absent_hub_checkpoint_offline_names_the_download_and_imports_nothing_heavy():
    """With HF_HUB_OFFLINE: the hub id's download command in the message, and neither torch nor transformers
    imported by the resolution (a fresh interpreter)."""
    code = (
        "import sys\nfrom mmkv.model.checkpoint import resolve_checkpoint\n"
        "try:\n    resolve_checkpoint('qwen3-vl-8b')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    first, heavy = done.stdout.strip().splitlines()
    assert first.startswith("ModelNotFoundError") and "HF_HUB_OFFLINE is set" in first
    assert "hf download Qwen/Qwen3-VL-8B-Instruct" in first and heavy == "[]"
