"""``ServerProcess``: ``python -m mmkv serve ...`` as a child process on a free port of 127.0.0.1, waited for
until ``/health`` answers (the tests and ``bench/serve.py`` drive servers this way, as vLLM's tests do)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

__all__ = ["ServerProcess", "free_port", "running", "stop"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen | None, timeout_s: float = 20.0) -> None:
    """SIGTERM ``process`` if it still runs (a server drains, then exits) and wait up to ``timeout_s``; SIGKILL
    it after that."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running(servers: list[ServerProcess]) -> Iterator[list[ServerProcess]]:
    """Start ``servers`` at once (each loads its model in its own process: on several cores the loads overlap),
    wait for all of them, yield them, and stop them all on exit. If any fails to start, the ones that came up
    are stopped and its error is raised."""
    errors: list[BaseException] = []

    def start(server: ServerProcess) -> None:
        try:
            server.__enter__()
        except BaseException as exc:  # noqa: BLE001 -- re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        yield servers
    finally:
        for server in servers:
            server.__exit__(None, None, None)


class ServerProcess:
    """A running ``mmkv serve``; a context manager (started on enter, stopped on exit)."""

    def __init__(
        self, args: list[str], log: Path, api_key: str | None = None, startup_s: float = 600.0
    ) -> None:
        self.args, self.log, self.api_key, self.startup_s = list(args), Path(log), api_key, startup_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        """Start the server and wait for ``/health``. A port another process takes between choosing it and the
        server binding it (other suites or servers on the machine) is retried on a new port, at most three times;
        any other exit raises ``RuntimeError`` with the log's end."""
        for _ in range(3):
            if self._start():
                return self
            self.port = free_port()
            self.base_url = f"http://127.0.0.1:{self.port}"
        raise RuntimeError(f"three free ports were taken before the server bound one: {self._log_end()}")

    def _log_end(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def _start(self) -> bool:
        """True once the server answers; False if it exited because its port was taken."""
        command = [sys.executable, "-m", "mmkv", "serve", "--port", str(self.port), *self.args]
        if self.api_key:
            command += ["--api-key", self.api_key]
        root = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        )
        with open(self.log, "w") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_s  # only to catch a server that never comes up
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        while True:
            if self.process.poll() is not None:
                end = self._log_end()
                if (
                    "already in use" in end
                ):  # our preflight's words, or uvicorn's "[Errno 98] ... already in use"
                    return False
                raise RuntimeError(f"the server exited: {end}")
            try:
                if httpx.get(f"{self.base_url}/health", headers=headers, timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the server did not come up: {self._log_end()}")
            time.sleep(0.2)

    def answered(self) -> int:
        """How many chat requests the server has answered with 200 so far (its ``/metrics``)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        for line in httpx.get(f"{self.base_url}/metrics", headers=headers, timeout=30).text.splitlines():
            if line.startswith('mmkv_requests_total{status="200"}'):
                return int(float(line.split()[-1]))
        return 0

    def kill(self) -> None:
        """SIGKILL the server (a fault test's crash: no drain, nothing flushed) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        """Start the server again on the same port (a replica rejoining behind a gateway); raises
        ``RuntimeError`` if it does not come up or the port was taken meanwhile."""
        self.kill()
        if not self._start():
            raise RuntimeError(f"port {self.port} was taken before the server could bind it again")

    def __exit__(self, *exc) -> None:
        stop(self.process)
