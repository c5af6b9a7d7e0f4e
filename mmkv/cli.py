"""The ``mmkv`` command (also ``python -m mmkv``): ``serve``, ``demo``, ``eval``, ``info``.

    mmkv serve --model small-qwen3-vl --port 8000 --store ~/.cache/mmkv
    mmkv demo --model small-qwen3-vl
    mmkv eval --model small-qwen3-vl --n 50
    mmkv info

An ``mmkv.MmkvError`` (a missing checkpoint, a store that cannot open, ...) ends the command with its one-line
message on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

from .errors import MmkvError

__all__ = ["HelpFormatter", "install_error_hook", "main", "one_line_errors"]

REPO = Path(__file__).resolve().parents[1]  # app/ and evals/ live beside the package in a checkout


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """For a script's ``__main__``: an ``mmkv.MmkvError`` ends it with ``prog: message`` on stderr and exit 2
    (no traceback: the message says what to change)."""
    try:
        yield
    except MmkvError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Scripts' ``--help``: the module docstring as written, and every option's default (unless it is None:
    such an option's help says what leaving it out means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


def install_error_hook(prog: str) -> None:
    """For scripts: an uncaught ``mmkv.MmkvError`` ends the process with ``prog: message`` on stderr and exit
    status 2, without a traceback (the message says what to change). Other exceptions are reported as usual."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if isinstance(value, MmkvError):
            print(f"{prog}: {value}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        previous(kind, value, traceback)

    sys.excepthook = hook


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server that reuses image KV across requests",
                       formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument(
        "--model", default="small-qwen3-vl", help="a name mmkv.load understands (also the served name)"
    )
    p.add_argument("--served-model-name", nargs="*", default=[], help="more names requests may use")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--store", action="append", default=[], help="a store directory (or redis:// URL); repeat for tiers"
    )
    p.add_argument(
        "--reuse", choices=["kv", "encoder", "none"], default="kv", help="how cached images are reused"
    )
    p.add_argument("--seam", type=int, default=1, help="tokens recomputed after each spliced image")
    p.add_argument("--allowed-media-domains", nargs="*", default=[], help="hosts http(s) image URLs may name")
    p.add_argument(
        "--allowed-local-media-path", type=Path, default=None, help="file:// images must lie under this"
    )
    p.add_argument(
        "--max-queue", type=int, default=16, help="waiting requests beyond the running one (then 503)"
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--pool-bytes", type=int, default=1 << 30, help="live caches kept between requests")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request gets 504")
    p.add_argument("--max-tokens", type=int, default=4096, help="bound on a request's max_tokens")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20, help="bigger request bodies get 413")
    p.add_argument("--max-image-bytes", type=int, default=20 << 20, help="bigger encoded images get 413")
    p.add_argument("--device", default=None, help="cpu or cuda; cuda when available if omitted")


def _serve(args) -> None:
    from .runtime import TurnPolicy
    from .serve import ServerConfig, serve

    serve(
        ServerConfig(
            model=args.model,
            served_names=tuple(args.served_model_name),
            host=args.host,
            port=args.port,
            stores=tuple(args.store),
            policy=TurnPolicy(args.reuse, args.seam),
            allowed_media_domains=tuple(args.allowed_media_domains),
            allowed_local_media_path=args.allowed_local_media_path,
            max_queue=args.max_queue,
            api_key=args.api_key,
            pool_bytes=args.pool_bytes,
            max_body_bytes=args.max_body_bytes,
            max_image_bytes=args.max_image_bytes,
            request_timeout_s=args.request_timeout,
            max_tokens=args.max_tokens,
            device=args.device,
        )  # fmt: skip
    )


def _script(relative: str, argv: list[str]) -> None:
    """Run one of the checkout's scripts (``app/demo.py``, ``evals/vqa.py``) with ``argv``."""
    path = REPO / relative
    if not path.is_file():
        raise MmkvError(
            f"{relative} is not here (it ships with the source checkout, not the package): {path}"
        )
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(REPO))
    runpy.run_path(str(path), run_name="__main__")


def _info(args) -> None:
    import torch
    import transformers

    from . import __version__
    from .model.registry import ALIASES, SHIPPED, SHIPPED_DIR, TINY

    shipped = [
        f"{name} ({'present' if (SHIPPED_DIR / d).is_dir() else 'missing'})" for name, d in SHIPPED.items()
    ]
    lines = [
        f"mmkv {__version__} (torch {torch.__version__}, transformers {transformers.__version__})",
        f"device: {'cuda' if torch.cuda.is_available() else 'cpu'}",
        f"shipped models: {', '.join(shipped)} in {SHIPPED_DIR}",
        f"tiny random-weight models: {', '.join(TINY)}",
        f"released checkpoints (download with `hf download <id>`): {', '.join(f'{a} -> {h}' for a, h in ALIASES.items())}",
        "stores: none by default (in memory, per process); pass --store DIR (e.g. ~/.cache/mmkv) to keep image "
        "KV on disk and share it between processes",
    ]
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="mmkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,demo,eval,info}")
    _serve_parser(sub)
    sub.add_parser("demo", help="the Gradio demo of an agent trajectory (app/demo.py; --help for its flags)",
                   add_help=False)  # fmt: skip
    sub.add_parser("eval", help="the VQA eval of every reuse mode against full recompute (evals/vqa.py)",
                   add_help=False)  # fmt: skip
    sub.add_parser("info", help="version, known models, where the stores live")
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "serve":
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            _serve(args)
        elif args.command == "demo":
            _script("app/demo.py", rest)
        elif args.command == "eval":
            _script("evals/vqa.py", rest)
        else:
            _info(args)
    except MmkvError as exc:
        print(f"mmkv: {exc}", file=sys.stderr)
        return 2
    return 0
