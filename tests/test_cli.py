"""The mmkv command and the scripts' command lines: subcommands, --help with defaults, info, and one-line
errors with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmkv.serve.process import free_port

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:  # a hang guard only
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
    """Every subcommand's --help exits 0 and lists its options with their defaults; a subcommand's usage line
    names the mmkv command (`usage: mmkv eval`), not the script's file name."""
    done = _run(*args)
    assert done.returncode == 0, done.stderr[-500:]
    for text in shown:
        assert text in done.stdout, text
    if args[:2] == ["-m", "mmkv"]:
        assert done.stdout.startswith(f"usage: mmkv {args[2]} "), done.stdout[:200]


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
    done = _run(*args, *(["--port", str(free_port())] if args[1:3] == ["mmkv", "serve"] else []))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-1500:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: ") and "Traceback" not in done.stderr
    if "--store" not in args:
        assert "hf download" in lines[0] and "--model DIR" in lines[0]
    else:
        assert "choose a writable directory" in lines[0] and "/proc/mmkv-cannot-be-here" in lines[0]


# -- serve: what can be checked is checked before the model loads, one line, exit 2 ----------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    """``mmkv serve`` in this process, with loading the model made an error: a check that passes lets it
    through and the test fails on "the model would load"."""
    import mmkv.serve

    def serve(config):
        raise AssertionError("the model would load")

    monkeypatch.setattr(mmkv.serve, "serve", serve)


def _serve_fails(capsys, *args: str) -> str:
    """Run ``mmkv serve ARGS`` in-process; assert exit 2 with one line on stderr, nothing on stdout; the line."""
    from mmkv.cli import main

    port = [] if "--port" in args else ["--port", str(free_port())]  # 8000 may be another program's
    try:
        status = main(["serve", "--model", "tiny-qwen3-vl", *port, *args])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("mmkv: ")
    return lines[0]


@pytest.mark.parametrize(
    "port, shown",
    [("99999", "99999"), ("65536", "65536"), ("0", "0"), ("-1", "-1"), ("abc", "'abc'"), ("80.5", "'80.5'"),
     ("", "''")],
)  # fmt: skip
def test_a_port_that_is_not_one_is_one_line(no_model_load, capsys, port, shown):
    """--port out of 1-65535, negative, not a number: one line naming --port and the range."""
    line = _serve_fails(capsys, "--port", port)
    assert line == f"mmkv: serve: argument --port: {shown} is not a port number (1-65535)"


def test_a_port_in_use_is_found_before_the_model_loads(no_model_load, capsys):
    """Another process listens on the port (on 127.0.0.1, or on every address with --host 0.0.0.0): one line
    saying so, before anything loads."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for host in ("127.0.0.1", "0.0.0.0"):
            line = _serve_fails(capsys, "--port", str(port), "--host", host)
            assert line == (
                f"mmkv: cannot listen on {host}:{port}: the port is already in use; stop what holds it or choose "
                "another --port"
            )


@pytest.mark.parametrize("host, reason", [("192.0.2.1", "is not an address of this machine"),
                                          ("no-such-host.invalid", "does not resolve")])  # fmt: skip
def test_a_host_that_is_not_this_machine_is_one_line(no_model_load, capsys, host, reason):
    """--host an address of another machine (TEST-NET-1) or a name that does not resolve."""
    line = _serve_fails(capsys, "--host", host, "--port", "8001")
    assert line.startswith(f"mmkv: cannot listen on {host}:8001: ") and reason in line


@pytest.mark.parametrize("model", ["/no/such/dir", "./no/such/dir", "~/no-such-mmkv-dir", "a/b/c"])
def test_a_model_path_that_does_not_exist_says_so(no_model_load, capsys, model):
    """--model naming a directory that is not there: says the directory does not exist (no hf download
    advice for a path)."""
    line = _serve_fails(capsys, "--model", model)
    assert line.startswith(f"mmkv: --model {model}: the directory ") and "does not exist" in line
    assert "hf download" not in line


def test_a_model_path_that_is_a_file_says_so(no_model_load, capsys, tmp_path):
    """--model naming a file: it is a file, not a checkpoint directory."""
    (tmp_path / "model.bin").write_bytes(b"x")
    line = _serve_fails(capsys, "--model", str(tmp_path / "model.bin"))
    assert "is a file, not a checkpoint directory" in line


@pytest.mark.parametrize("form", ["under /proc", "a file in the way", "under a file"])
def test_an_unwritable_store_is_found_before_the_model_loads(no_model_load, capsys, tmp_path, form):
    """--store that cannot be created or written (under /proc, a file where the directory should be, a path
    under a file): one line naming it; the file in the way is unchanged."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"keep me")
    path = {"under /proc": "/proc/mmkv-cannot-be-here", "a file in the way": str(blocker),
            "under a file": str(blocker / "store")}[form]  # fmt: skip
    line = _serve_fails(capsys, "--store", path)
    assert line.startswith(f"mmkv: cannot open the store directory {path!r}: ")
    assert blocker.read_bytes() == b"keep me"


@pytest.mark.parametrize("flag, value, name", [("--max-queue", "-1", "max_queue"), ("--pool-bytes", "-5", "pool_bytes"),
                                               ("--max-tokens", "0", "max_tokens"), ("--request-timeout", "0", "request_timeout_s"),
                                               ("--header-timeout", "-1", "header_timeout_s"), ("--max-connections", "0", "max_connections"),
                                               ("--layout-cache-bytes", "0", "layout_cache_bytes"),
                                               ("--seam", "4097", "seam"), ("--seam", "-1", "seam"),
                                               ("--budget", "1.5", "budget"), ("--budget", "nan", "budget")])  # fmt: skip
def test_a_bound_out_of_range_is_one_line(no_model_load, capsys, flag, value, name):
    """A negative queue or pool, zero max tokens, a zero timeout, a seam over ``MAX_SEAM`` (the policy's own
    bound, the request's too), a budget outside [0, 1]: one line naming the setting."""
    line = _serve_fails(capsys, flag, value)
    assert line.startswith("mmkv: serve: ") and name in line


def test_every_memory_bound_of_the_server_has_a_flag(monkeypatch):
    """Each ``*_bytes`` field of ServerConfig (the memory the server holds, and body and image sizes) is set by
    its ``--*-bytes`` flag: the config the command builds carries the value given."""
    import dataclasses

    import mmkv.serve
    from mmkv.cli import main
    from mmkv.serve import ServerConfig

    fields = [f.name for f in dataclasses.fields(ServerConfig) if f.name.endswith("_bytes")]
    assert {"pool_bytes", "kv_memory_bytes", "encoder_memory_bytes", "image_cache_bytes", "decode_budget_bytes",
            "layout_cache_bytes"} <= set(fields)  # fmt: skip
    built = []
    monkeypatch.setattr(mmkv.serve, "serve", built.append)
    monkeypatch.setattr("mmkv.cli._preflight", lambda args: None)
    flags = [x for k, name in enumerate(fields) for x in ("--" + name.replace("_", "-"), str(1000 + k))]
    main(["serve", "--model", "tiny-qwen3-vl", *flags])
    assert [getattr(built[0], name) for name in fields] == [1000 + k for k in range(len(fields))]


def test_the_command_line_itself_exits_2_with_one_line():
    """python -m mmkv serve --port 99999: exit 2, one line, no usage block, no traceback."""
    done = _run("-m", "mmkv", "serve", "--port", "99999")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "mmkv: serve: argument --port: 99999 is not a port number (1-65535)"
    ]


# -- answering at once: --help, flag errors and the checks before the model never import torch ----------------

_NO_TORCH_RUNNER = """
import contextlib, io, json, sys
from mmkv.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:
        status = exc.code
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(json.dumps({"status": status, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy}))
"""


def _answer_without_torch(*args: str) -> dict:
    """``mmkv ARGS`` in a fresh interpreter: its exit status, stdout, stderr and which of torch / transformers
    it imported."""
    import json

    done = _run("-c", _NO_TORCH_RUNNER, *args)
    assert done.returncode == 0, done.stderr[-1500:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "args, status, shown",
    [
        (["--help"], 0, "usage: mmkv "),
        (["serve", "--help"], 0, "--max-queue"),
        (["serve", "--no-such-flag"], 2, "mmkv: unrecognized arguments: --no-such-flag"),
        (["serve", "--port", "0"], 2, "mmkv: serve: argument --port: 0 is not a port number (1-65535)"),
        (["serve", "--max-queue", "x"], 2, "argument --max-queue: invalid int value: 'x'"),
        (["serve", "--model", "qwen3-vl-9b"], 2, "Did you mean qwen3-vl-8b"),
        (["serve", "--model", "/no/such/dir"], 2, "does not exist"),
        (["serve", "--model", "qwen3-vl-8b"], 2, "hf download Qwen/Qwen3-VL-8B-Instruct"),
        (["serve", "--model", "someone/no-such-checkpoint"], 2, "hf download someone/no-such-checkpoint"),
        (["eval", "--model", "qwen3-vl-8b", "--n", "1"], 2, "hf download Qwen/Qwen3-VL-8B-Instruct"),
        (["demo", "--model=qwen2.5-vl-7b"], 2, "hf download Qwen/Qwen2.5-VL-7B-Instruct"),
        (["serve", "--store", "/proc/mmkv-cannot-be-here"], 2, "cannot open the store directory"),
        (["nosuchcommand"], 2, "invalid choice: 'nosuchcommand'"),
    ],
)
def test_help_flag_errors_and_checks_answer_before_torch(args, status, shown):
    """--help, a flag that does not exist or has a bad value, a mistyped model name, a missing model directory,
    a released checkpoint or hub id that is not here, and an unwritable store all answer (exit status and message) without importing torch or transformers."""
    port = ["--port", str(free_port())] if args[:1] == ["serve"] and "--port" not in args else []
    answer = _answer_without_torch(*args, *port)
    assert answer["status"] == status and shown in answer["out"] + answer["err"], answer
    assert answer["heavy"] == []


def test_a_port_in_use_answers_before_torch():
    """A port another process listens on is found without importing torch."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        answer = _answer_without_torch("serve", "--port", str(taken.getsockname()[1]))
    assert answer["status"] == 2 and "the port is already in use" in answer["err"] and answer["heavy"] == []


@pytest.mark.parametrize(
    "model, close",
    [("qwen3-vl-9b", "qwen3-vl-8b"), ("small-qwen3vl", "small-qwen3-vl"), ("tiny-qwen3", "tiny-qwen3-vl")],
)
def test_a_mistyped_model_name_gets_did_you_mean_and_no_download_advice(model, close):
    """A name that is neither known nor a hub id (org/name): "did you mean" the closest known names, the known
    names listed, and no `hf download` advice (there is nothing to download); in Python too."""
    import mmkv

    answer = _answer_without_torch("serve", "--model", model, "--port", str(free_port()))
    line = answer["err"].strip()
    assert answer["status"] == 2 and len(line.splitlines()) == 1
    assert f"Did you mean {close}" in line and "Known names: " in line and "hf download" not in line
    with pytest.raises(mmkv.ModelNotFoundError, match=f"Did you mean {close}") as raised:
        mmkv.load(model)
    assert "hf download" not in str(raised.value)
