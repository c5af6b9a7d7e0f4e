"""mmkv.serve.process.ServerProcess: a port taken by someone else before the server binds it is retried."""

from __future__ import annotations

import socket

import httpx
import pytest

from mmkv.serve import process as process_module
from mmkv.serve.process import ServerProcess, free_port

pytestmark = pytest.mark.server


def test_a_taken_port_is_retried_on_a_new_one(tmp_path, monkeypatch):
    """The first port handed out is held (listening) by another socket, as another suite's server would: the
    server's own check refuses it, and ServerProcess starts it on the next free port, which then answers."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(process_module, "free_port", lambda: next(ports, None) or free_port())
    try:
        with ServerProcess(["--model", "tiny-qwen3-vl", "--device", "cpu"], tmp_path / "log") as server:
            assert server.port != taken
            assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    finally:
        holder.close()


def test_any_other_exit_is_an_error_with_the_log(tmp_path):
    with pytest.raises(RuntimeError, match="the server exited: .*no-such-model"):
        with ServerProcess(["--model", "/no/such/dir/no-such-model"], tmp_path / "log"):
            pass
