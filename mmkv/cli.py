"""The ``mmkv`` command (also ``python -m mmkv``): ``serve``, ``demo``, ``eval``, ``info``.

    mmkv serve --model small-qwen3-vl --port 8000 --store ~/.cache/mmkv
    mmkv demo --model small-qwen3-vl
    mmkv eval --model small-qwen3-vl --n 50
    mmkv info

An ``mmkv.MmkvError`` (a missing checkpoint, a store that cannot open, ...) ends the command with its one-line
message on stderr and exit status 2. ``serve`` checks what it can before the model loads, each a one-line exit 2:
the flags (a port outside 1-65535, a bound out of range, a value that is not a number), whether it can listen on
``--host:--port`` (a port in use, an address not of this machine), a ``--model`` path that does not exist or a
name that is no known name and no hub id (with the closest known names), and whether every ``--store``
directory can be written. ``--help``, the flags' errors and these checks answer before torch and transformers are
imported (this module imports neither; the bounds check, which needs the server's config, comes last).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
import types
from collections.abc import Iterator
from pathlib import Path

from .errors import MmkvError
from .policy import MAX_SEAM, REPAIRS, REUSE_POLICIES

__all__ = ["HelpFormatter", "OneLineParser", "install_error_hook", "main", "one_line_errors", "serve_config"]

REPO = Path(__file__).resolve().parents[1]  # app/ and evals/ live beside the package in a checkout
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # --store URLs (the rest are directories)


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


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (``mmkv: serve: argument --port: ...``) and exit
    status 2, like every other mmkv error, instead of the usage block."""

    def error(self, message: str):
        command = self.prog.removeprefix("mmkv").strip()
        print(f"mmkv: {command + ': ' if command else ''}{message}", file=sys.stderr)
        raise SystemExit(2)


def _port(text: str) -> int:
    """argparse type of ``--port``: an integer 1-65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _can_listen(host: str, port: int) -> None:
    """Bind ``host:port`` the way uvicorn will (SO_REUSEADDR) and let go at once; ``MmkvError`` with the reason
    when that fails (a port in use, an address that is not this machine's, a privileged port, no such host)."""
    where = f"cannot listen on {host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise MmkvError(
            f"{where}: --host {host!r} does not resolve ({exc}); pass an address of this machine"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            reasons = {
                errno.EADDRINUSE: "the port is already in use; stop what holds it or choose another --port",
                errno.EADDRNOTAVAIL: f"{host} is not an address of this machine; choose another --host",
                errno.EACCES: "no permission (ports below 1024 need privileges); choose another --port",
            }
            raise MmkvError(f"{where}: {reasons.get(exc.errno, exc.strerror)}") from None


def _is_path(model: str) -> bool:
    """Whether ``--model`` names a directory rather than a known name or a hub id (``org/name``)."""
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1


def _preflight(args) -> None:
    """What ``serve`` can check before loading the model, without importing torch (see the module docstring).
    Raises ``MmkvError``; creates the store directories (as the store would), nothing else."""
    from .cache.directory import check_store_directory
    from .model.registry import is_hub_id, known_names, unknown_name_message

    _can_listen(args.host, args.port)
    model = Path(args.model).expanduser()
    if _is_path(args.model) and not model.is_dir():
        what = "is a file, not a checkpoint directory" if model.exists() else "does not exist"
        raise MmkvError(
            f"--model {args.model}: the directory {str(model)!r} {what}; pass a checkpoint directory, a name "
            "from `mmkv info`, or a Hugging Face id"
        )
    if not (model.is_dir() or is_hub_id(args.model) or args.model.lower() in known_names()):
        raise MmkvError(unknown_name_message(args.model))
    _require_checkpoint(args.model)
    for entry in args.store:
        if not entry.startswith(_REDIS_SCHEMES):  # Redis may come up later: not required now
            check_store_directory(Path(entry).expanduser())


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server that reuses image KV across requests",
                       formatter_class=HelpFormatter)  # fmt: skip
    p.add_argument(
        "--model", default="small-qwen3-vl", help="a name mmkv.load understands (also the served name)"
    )
    p.add_argument("--served-model-name", nargs="*", default=[], help="more names requests may use")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (1-65535)")
    p.add_argument(
        "--store", action="append", default=[], help="a store directory (or redis:// URL); repeat for tiers"
    )
    policy = p.add_argument_group('reuse policy (the default; a request\'s {"mmkv": {...}} overrides it)')
    policy.add_argument("--reuse", choices=REUSE_POLICIES, default="kv", help="how cached images are reused")
    policy.add_argument("--seam", type=int, default=1,
                        help=f"tokens recomputed at the start of each spliced segment (0-{MAX_SEAM})")  # fmt: skip
    policy.add_argument("--repair", choices=REPAIRS, default="seam",
                        help="how spliced tokens beyond the seam are chosen for recompute")  # fmt: skip
    policy.add_argument("--budget", type=float, default=None,
                        help="share of each segment's spliced tokens recomputed (0-1; default: the repair's)")  # fmt: skip
    p.add_argument("--allowed-media-domains", nargs="*", default=[], help="hosts http(s) image URLs may name")
    p.add_argument(
        "--allowed-local-media-path", type=Path, default=None, help="file:// images must lie under this"
    )
    p.add_argument(
        "--max-queue", type=int, default=16, help="waiting requests beyond the running ones (then 503)"
    )
    batching = p.add_argument_group("batching (the engine: continuous batching over spliced sequences)")
    batching.add_argument("--max-batch", type=int, default=8,
                          help="requests prefilling or decoding at once; 1: one at a time")  # fmt: skip
    batching.add_argument("--max-batch-kv-bytes", type=int, default=2 << 30,
                          help="bound on the decode batch's KV (rows padded to the longest)")  # fmt: skip
    batching.add_argument("--prefill-chunk", type=int, default=512,
                          help="prompt tokens computed per step while others decode (>= 16)")  # fmt: skip
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route")
    p.add_argument("--open-health", action="store_true", help="with --api-key: /health answers without it")
    p.add_argument("--open-metrics", action="store_true", help="with --api-key: /metrics answers without it")
    memory = p.add_argument_group("memory the server holds (each bounded; the defaults fit a 24 GB machine)")
    memory.add_argument("--pool-bytes", type=int, default=1 << 30, help="live caches kept between requests")
    memory.add_argument("--kv-memory-bytes", type=int, default=2 << 30, help="image KV kept in memory")
    memory.add_argument(
        "--encoder-memory-bytes", type=int, default=512 << 20, help="vision outputs in memory"
    )
    memory.add_argument("--image-cache-bytes", type=int, default=256 << 20,
                        help="decoded images and preprocessed pixels kept (each)")  # fmt: skip
    memory.add_argument("--decode-budget-bytes", type=int, default=1 << 30,
                        help="memory images may take while they decode, all requests together")  # fmt: skip
    memory.add_argument("--layout-cache-bytes", type=int, default=64 << 20,
                        help="rendered messages and earlier requests' layouts kept")  # fmt: skip
    memory.add_argument("--grammar-cache-bytes", type=int, default=256 << 20,
                        help="checked schemas and compiled grammars kept")  # fmt: skip
    limits = p.add_argument_group("time, connections and sizes")
    limits.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds from a request's arrival to its answer, then 504")  # fmt: skip
    limits.add_argument("--header-timeout", type=float, default=10.0, help="seconds for a request's headers")
    limits.add_argument("--body-timeout", type=float, default=60.0, help="seconds for a request's body (408)")
    limits.add_argument("--keep-alive", type=float, default=5.0, help="seconds an idle connection stays open")
    limits.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM: new requests get 503 and /health 503 'draining'; seconds the requests "
                             "held may take before the server exits")  # fmt: skip
    limits.add_argument("--max-connections", type=int, default=512, help="open connections at once")
    limits.add_argument("--max-fetches", type=int, default=8, help="http(s) image fetches at once")
    limits.add_argument("--max-tokens", type=int, default=4096, help="bound on a request's max_tokens")
    limits.add_argument("--max-schema-bytes", type=int, default=64 << 10,
                        help="bigger JSON schemas (a request's response format and tools, together) get 400")  # fmt: skip
    limits.add_argument("--max-body-bytes", type=int, default=64 << 20, help="bigger request bodies get 413")
    limits.add_argument("--max-image-bytes", type=int, default=20 << 20, help="bigger encoded images get 413")
    limits.add_argument(
        "--max-image-pixels", type=int, default=64 << 20, help="bigger decoded images get 413"
    )
    p.add_argument("--device", default=None, help="cpu or cuda; cuda when available if omitted")


def _serve(args) -> None:
    _preflight(args)  # before torch: the address, --model and the store directories
    from .serve import serve

    serve(_server_config(args))


def serve_config(argv: list[str]):
    """The ``ServerConfig`` that ``mmkv serve ARGV`` runs (no preflight: nothing is checked or bound). Raises
    ``MmkvError`` for a bound out of range, ``SystemExit`` (argparse) for a flag it does not take."""
    parser = OneLineParser(prog="mmkv")
    _serve_parser(parser.add_subparsers(dest="command", required=True))
    return _server_config(parser.parse_args(["serve", *argv]))


def _server_config(args):
    from .policy import TurnPolicy
    from .serve import ServerConfig

    try:
        config = ServerConfig(
            model=args.model,
            served_names=tuple(args.served_model_name),
            host=args.host,
            port=args.port,
            stores=tuple(args.store),
            policy=TurnPolicy(args.reuse, args.seam, repair=args.repair, budget=args.budget),
            allowed_media_domains=tuple(args.allowed_media_domains),
            allowed_local_media_path=args.allowed_local_media_path,
            max_queue=args.max_queue,
            max_batch=args.max_batch,
            max_batch_kv_bytes=args.max_batch_kv_bytes,
            prefill_chunk=args.prefill_chunk,
            api_key=args.api_key,
            open_health=args.open_health,
            open_metrics=args.open_metrics,
            pool_bytes=args.pool_bytes,
            kv_memory_bytes=args.kv_memory_bytes,
            encoder_memory_bytes=args.encoder_memory_bytes,
            image_cache_bytes=args.image_cache_bytes,
            decode_budget_bytes=args.decode_budget_bytes,
            layout_cache_bytes=args.layout_cache_bytes,
            grammar_cache_bytes=args.grammar_cache_bytes,
            max_schema_bytes=args.max_schema_bytes,
            request_timeout_s=args.request_timeout,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive,
            drain_timeout_s=args.drain_timeout,
            max_connections=args.max_connections,
            max_fetches=args.max_fetches,
            max_body_bytes=args.max_body_bytes,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            max_tokens=args.max_tokens,
            device=args.device,
        )
    except ValueError as exc:  # a bound out of range: say which, before anything loads
        raise MmkvError(f"serve: {exc}") from None
    return config


def _require_checkpoint(model: str) -> None:
    """``--model``'s checkpoint is here (or fetched, as ``mmkv.load`` would): a missing one is its one line now,
    not after torch and transformers load. A tiny model has none to find."""
    from .model.checkpoint import resolve_checkpoint
    from .model.registry import TINY

    if model.lower() not in TINY:
        resolve_checkpoint(model)


def _check_model(argv: list[str]) -> None:
    """A script's ``--model`` (``_require_checkpoint``), before the script imports torch; its own checks, and
    anything else it refuses, stay the script's."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--model")
    peek.add_argument("-h", "--help", action="store_true")
    known, _ = peek.parse_known_args(argv)
    if known.model and not known.help:
        _require_checkpoint(known.model)


def _script(relative: str, argv: list[str], prog: str) -> None:
    """Run one of the checkout's scripts (``app/demo.py``, ``evals/vqa.py``) with ``argv``, as ``prog`` (its
    argparse usage and errors say ``mmkv eval``, not ``vqa.py``)."""
    path = REPO / relative
    if not path.is_file():
        raise MmkvError(
            f"{relative} is not here (it ships with the source checkout, not the package): {path}"
        )
    _check_model(argv)
    sys.argv = [prog, *argv]
    sys.path.insert(0, str(REPO))
    # as runpy.run_path(path, run_name="__main__") does, but keeping sys.argv[0] (run_path sets it to the path)
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


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
    parser = OneLineParser(
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
            _script("app/demo.py", rest, "mmkv demo")
        elif args.command == "eval":
            _script("evals/vqa.py", rest, "mmkv eval")
        else:
            _info(args)
    except MmkvError as exc:
        print(f"mmkv: {exc}", file=sys.stderr)
        return 2
    return 0
