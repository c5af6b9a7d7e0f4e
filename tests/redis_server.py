"""A real ``redis-server`` for the tests: on a free port of 127.0.0.1, persistence off, stopped afterwards."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from mmkv.serve.process import free_port


class RedisServer:
    """``redis-server`` as a child process (``start`` / ``kill`` / ``restart`` for fault tests)."""

    def __init__(self, maxmemory: str | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
        self.port, self.maxmemory = free_port(), maxmemory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--protected-mode", "no"]  # fmt: skip
        if self.maxmemory:
            command += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=0.5)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=1)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
