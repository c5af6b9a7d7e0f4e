"""Real servers for the tests: what ``mmkv serve`` runs, on a free port of 127.0.0.1, driven with ``openai``."""

from __future__ import annotations

import base64
import io
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from mmkv.cli import serve_config
from mmkv.serve import http_server
from mmkv.serve.process import ServerProcess
from tests.conftest import random_image

PATCH = 16  # tiny-qwen3-vl's patch size


class RunningServer(ServerProcess):
    """A server process and how to reach it with the openai client and plain HTTP."""

    def client(self, **kwargs) -> OpenAI:
        return OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def post(self, body, headers=None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}", **(headers or {})} if self.api_key else headers
        url = f"{self.base_url}/v1/chat/completions"
        if isinstance(body, (bytes, str)):
            return httpx.post(url, content=body, headers=headers, timeout=300, **kwargs)
        return httpx.post(url, json=body, headers=headers, timeout=300, **kwargs)

    def get(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        return httpx.get(f"{self.base_url}{path}", headers=headers, timeout=60)


class InProcessServer(RunningServer):
    """``mmkv serve ARGS`` in this process: the configuration ``mmkv serve`` would run (``serve_config``), the
    same uvicorn server on a real port of 127.0.0.1 (``http_server``) on a thread of its own, the model worker
    on its own. What a client sees is what a server process answers; what it saves is the ~5 s a process
    spends importing torch and transformers. Signals, exits and the process's memory are the process tests'
    (``ServerProcess``: test_drain, test_process, test_limits' memory bounds, the gateway)."""

    def _start(self) -> bool:
        """True once the server is up; False if uvicorn could not bind the port (``ServerProcess.__enter__``
        then retries on a new one, as for a process)."""
        argv = ["--port", str(self.port), *self.args, *(["--api-key", self.api_key] if self.api_key else [])]
        self.http, self.engine = http_server(serve_config(argv))
        self.thread = threading.Thread(target=self.http.run, name="mmkv-test-server", daemon=True)
        self.thread.start()
        while not self.http.started and self.thread.is_alive():
            time.sleep(0.02)
        if not self.http.started:  # uvicorn exits its thread when the port is taken
            self.engine.close()
        return self.http.started

    def _log_end(self) -> str:
        return "(an in-process server: its log is the test's)"

    def __exit__(self, *exc) -> None:
        self.http.should_exit = True
        self.thread.join()
        self.engine.close()


@contextmanager
def run_server(tmp: Path, *args: str, api_key: str | None = None, process: bool = False):
    """``mmkv serve`` on tiny-qwen3-vl with ``args``, up and serving: in this process (``InProcessServer``), or
    with ``process`` as ``python -m mmkv serve`` in a process of its own (for signals and exits)."""
    kind = RunningServer if process else InProcessServer
    with kind(["--model", "tiny-qwen3-vl", "--device", "cpu", *args], tmp / "server.log", api_key) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    """The default server (kv, a file:// directory allowed, small body and image bounds for the 413 tests)."""
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "media").mkdir()
    with run_server(tmp, "--allowed-local-media-path", str(tmp / "media"), "--max-body-bytes", "2000000",
                    "--max-image-bytes", "300000") as running:  # fmt: skip
        running.media = tmp / "media"
        yield running


def png(seed: int, grid=(4, 6)) -> bytes:
    buffer = io.BytesIO()
    random_image(seed, grid, PATCH).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(seed: int, grid=(4, 6)) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed, grid)).decode()


def image_part(seed: int, grid=(4, 6)) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed, grid)}}


def user(*parts) -> dict:
    return {
        "role": "user",
        "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts],
    }
