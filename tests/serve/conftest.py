"""Real servers for the tests: ``python -m mmkv serve`` on a free port of 127.0.0.1, driven with ``openai``."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.conftest import random_image

ROOT = Path(__file__).resolve().parents[2]
PATCH = 16  # tiny-qwen3-vl's patch size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """A server process and how to reach it."""

    def __init__(self, process: subprocess.Popen, port: int, log: Path, api_key: str | None) -> None:
        self.process, self.port, self.log, self.api_key = process, port, log, api_key
        self.base_url = f"http://127.0.0.1:{port}"

    def client(self, **kwargs) -> OpenAI:
        return OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def post(self, body, headers=None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}", **(headers or {})} if self.api_key else headers
        if isinstance(body, (bytes, str)):
            return httpx.post(
                f"{self.base_url}/v1/chat/completions", content=body, headers=headers, timeout=60, **kwargs
            )
        return httpx.post(
            f"{self.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60, **kwargs
        )

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=30)


@contextmanager
def run_server(tmp: Path, *args: str, api_key: str | None = None):
    """Start ``mmkv serve`` on tiny-qwen3-vl with ``args``; yields a ``RunningServer`` once /health answers."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    command = [sys.executable, "-m", "mmkv", "serve", "--model", "tiny-qwen3-vl", "--port", str(port),
               "--device", "cpu", *args, *(["--api-key", api_key] if api_key else [])]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, port, log, api_key)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
            try:
                if server.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


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
