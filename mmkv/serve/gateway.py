"""``GatewayProcess``: the Shepherd Model Gateway (``smg launch``, the ``gateway`` extra) in front of ``mmkv
serve`` replicas, as the README's Scale out section deploys it; a child process on a free port of 127.0.0.1,
waited for until every replica is routable. The tests and ``bench/gateway.py`` drive it; nothing in the server
imports it.

Why SMG: it routes to any OpenAI-compatible worker over HTTP and passes bodies and streams through unchanged (the
``mmkv`` reply field, tool calls, error objects), checks workers' ``/health`` and routes around a failed one, and
its ``cache_aware`` policy keeps a conversation on the replica that served its earlier turns (a radix tree of the
request text per worker: a resent history shares its prefix with the last turn) while balancing load; one Rust
binary in a manylinux wheel, pinned in ``pyproject.toml``.

    with GatewayProcess([a.base_url, b.base_url], log) as gateway:     # policy cache_aware
        OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused")   # any agent, unchanged
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .process import free_port

__all__ = ["AGENT_POLICY", "GatewayProcess", "gateway_binary", "gateway_command"]

AGENT_POLICY = "cache_aware"  # keeps a conversation on its replica; see the module docstring
# what the deployment sets beyond smg's defaults: health checked every second, a worker out after 2 failed
# checks (a killed replica leaves the rotation within ~2 s; SIGTERM's draining /health 503 takes it out the same
# way), back after 1 good one; a request whose worker failed is retried on another at most twice
HEALTH_FLAGS = ("--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "2", "--health-success-threshold", "1",
                "--retry-max-retries", "2")  # fmt: skip


def gateway_binary() -> str | None:
    """The ``smg`` executable beside this Python (the ``gateway`` extra's wheel) or on ``PATH``; None if absent."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


def gateway_command(
    binary: str, workers: list[str], port: int, policy: str = AGENT_POLICY, metrics_port: int | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:  # fmt: skip
    """The ``smg launch`` command line for ``workers`` (base URLs) on 127.0.0.1:``port``, ``extra`` flags
    last. Pure."""
    command = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", policy, *HEALTH_FLAGS, "--prometheus-host", "127.0.0.1"]  # fmt: skip
    return command + [
        "--prometheus-port",
        str(metrics_port if metrics_port is not None else free_port()),
        *extra,
    ]


class GatewayProcess:
    """A running gateway over ``workers``; a context manager (started on enter, stopped on exit). Raises
    ``FileNotFoundError`` when no ``smg`` is installed (``pip install -e ".[gateway]"``)."""

    def __init__(
        self, workers: list[str], log: Path, policy: str = AGENT_POLICY, startup_s: float = 120.0,
        extra: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.workers, self.log, self.policy, self.startup_s = list(workers), Path(log), policy, startup_s
        self.extra = tuple(extra)  # more smg flags (a policy's tuning)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> GatewayProcess:
        """Start the gateway and wait until it routes to every worker (``GET /workers`` lists them healthy)."""
        binary = gateway_binary()
        if binary is None:
            raise FileNotFoundError('no smg gateway is installed: pip install -e ".[gateway]" (pins smg)')
        with open(self.log, "w") as sink:
            self.process = subprocess.Popen(gateway_command(binary, self.workers, self.port, self.policy, extra=self.extra),
                                            stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
        if not self._routes_to(len(self.workers), self.startup_s):
            self.__exit__(None, None, None)
            raise RuntimeError(f"the gateway did not come up: {self.log.read_text(errors='replace')[-2000:]}")
        return self

    def healthy_workers(self) -> int:
        """How many workers the gateway would route to now (0 while it is not answering)."""
        try:
            listed = httpx.get(f"{self.base_url}/workers", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(1 for worker in listed.get("workers", []) if worker.get("is_healthy"))

    def wait_healthy(self, count: int, timeout_s: float = 60.0) -> None:
        """Wait until the gateway routes to exactly ``count`` workers; ``TimeoutError`` after ``timeout_s`` (a
        bound for a gateway that never notices, not a measurement)."""
        if not self._routes_to(count, timeout_s):
            raise TimeoutError(f"the gateway never routed to {count} workers (now {self.healthy_workers()})")

    def _routes_to(self, count: int, timeout_s: float) -> bool:
        """Poll until the gateway routes to exactly ``count`` workers (True), it exits or ``timeout_s`` passes
        (False)."""
        deadline = time.monotonic() + timeout_s
        while self.healthy_workers() != count:
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def __exit__(self, *exc) -> None:
        """Stop the gateway: SIGKILL (it holds no state, and SIGTERM keeps its listener open for a 5 s settle)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
