"""The mmkv command and the scripts' command lines: subcommands, --help with defaults, info, and one-line
errors with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_the_command_lists_its_subcommands():
    """python -m mmkv --help names serve, demo, eval and info."""
    done = _run("-m", "mmkv", "--help")
    assert done.returncode == 0
    for name in ("serve", "demo", "eval", "info"):
        assert name in done.stdout


@pytest.mark.parametrize(
    "args, shown",
    [
        (
            ["-m", "mmkv", "serve", "--help"],
            ["--allowed-media-domains", "--max-queue", "default: 8000", "--api-key"],
        ),
        (["-m", "mmkv", "demo", "--help"], ["--store", "--port", "default: 7860"]),
        (["-m", "mmkv", "eval", "--help"], ["--n", "default: 200", "--arms"]),
        (["evals/edit.py", "--help"], ["--model", "default:"]),
    ],
)
def test_each_help_shows_its_options_with_defaults(args, shown):
    """Every subcommand's --help exits 0 and lists its options with their defaults."""
    done = _run(*args)
    assert done.returncode == 0, done.stderr[-500:]
    for text in shown:
        assert text in done.stdout, text


def test_info_says_version_models_and_stores():
    """mmkv info: the version, the shipped and tiny models, the hub aliases, where the stores live."""
    done = _run("-m", "mmkv", "info")
    assert done.returncode == 0
    out = done.stdout
    assert out.startswith("mmkv 0.1.0") and "small-qwen3-vl (present)" in out and "tiny-qwen3-vl" in out
    assert "qwen3-vl-8b -> Qwen/Qwen3-VL-8B-Instruct" in out and "--store DIR" in out


@pytest.mark.parametrize(
    "args, prog",
    [
        (["-m", "mmkv", "serve", "--model", "qwen3-vl-8b"], "mmkv"),
        (["-m", "mmkv", "eval", "--model", "qwen3-vl-8b", "--n", "1"], "mmkv"),
        (["evals/vqa.py", "--model", "/no/such/checkpoint"], "evals/vqa.py"),
        (["evals/edit.py", "--model", "qwen2.5-vl-7b"], "evals/edit.py"),
        (["examples/trajectory.py", "--model", "qwen3-vl-8b"], "examples/trajectory.py"),
        (["-m", "mmkv", "serve", "--model", "tiny-qwen3-vl", "--store", "/proc/mmkv-cannot-be-here"], "mmkv"),
    ],
)
def test_a_missing_checkpoint_or_store_is_one_line_and_exit_2(args, prog):
    """No traceback: one line naming the problem and what to run (hf download, --model DIR), exit status 2."""
    done = _run(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-1500:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: ") and "Traceback" not in done.stderr
    if "--store" not in args:
        assert "hf download" in lines[0] and "--model DIR" in lines[0]
    else:
        assert "choose a writable directory" in lines[0] and "/proc/mmkv-cannot-be-here" in lines[0]
