"""The benchmarks' model arguments, in one place: a name ``mmkv.load`` understands (``--model``), or random
weights of a released model's size (``--arch``, optionally cut to ``--lm-layers`` / ``--vision-layers``), on a
``--device`` in a ``--dtype``. Example::

    parser = argparse.ArgumentParser()
    add_model_arguments(parser, default="tiny-qwen3-vl")
    args = parser.parse_args(["--arch", "qwen2.5-vl-7b", "--lm-layers", "4"])
    handle = load_model(args)                 # random weights at 7B width, 4 LM layers
    model_arguments(args)                     # ["--arch", "qwen2.5-vl-7b", "--lm-layers", "4"] for a subprocess
"""

from __future__ import annotations

import argparse

import torch

import mmkv
from mmkv.model.reference import REFERENCE_ARCHS, build_reference

__all__ = ["add_model_arguments", "load_model", "model_arguments"]


def add_model_arguments(
    parser: argparse.ArgumentParser,
    default: str = "tiny-qwen3-vl",
    *,
    arch: bool = True,
    device: str | None = None,
) -> None:
    """Add ``--model`` (and with ``arch`` ``--arch``, ``--lm-layers``, ``--vision-layers``), ``--device`` and
    ``--dtype`` to ``parser``."""
    parser.add_argument("--model", default=default, help="a name mmkv.load understands")
    if arch:
        parser.add_argument(
            "--arch", choices=REFERENCE_ARCHS, help="random weights of a released model's size"
        )
        parser.add_argument(
            "--lm-layers", type=int, default=None, help="with --arch: language-model layers kept"
        )
        parser.add_argument("--vision-layers", type=int, default=None, help="with --arch: vision layers kept")
    parser.add_argument("--device", default=device, help="cpu or cuda (default: mmkv.load's)")
    parser.add_argument("--dtype", default="float32")


def load_model(args: argparse.Namespace, min_positions: int | None = None) -> mmkv.ModelHandle:
    """The handle the arguments name; with ``min_positions``, one whose position bound is at least that (a new
    handle: nothing shared is changed)."""
    dtype = getattr(torch, args.dtype)
    if getattr(args, "arch", None):
        handle = build_reference(args.arch, args.lm_layers, args.vision_layers, args.device or "cpu", dtype)
    else:
        handle = mmkv.load(args.model, device=args.device, dtype=dtype)
    if min_positions is not None and handle.max_positions < min_positions:
        handle = handle.with_position_limit(min_positions)
    return handle


def model_arguments(args: argparse.Namespace) -> list[str]:
    """The arguments that name the same model to another benchmark process."""
    if getattr(args, "arch", None):
        out = ["--arch", args.arch]
        out += ["--lm-layers", str(args.lm_layers)] if args.lm_layers else []
        return out + (["--vision-layers", str(args.vision_layers)] if args.vision_layers else [])
    return ["--model", args.model]
