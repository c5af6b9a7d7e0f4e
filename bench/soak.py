"""A bounded soak of ``mmkv serve``: about a thousand requests of growing conversations with new screenshots, the
server's resident memory sampled all along; with every memory bound set small, RSS must level off once the
bounds are full instead of climbing with the requests served.

Agents (``bench.serve.screenshot_requests``: a new screenshot per turn, the last few kept, the whole history
resent) run in waves of ``--concurrency`` at once, each wave with new pictures, until ``--requests`` were
answered or ``--minutes`` passed. RSS (``/proc/<pid>/status`` VmRSS) and the pool's bytes are sampled every
``--every`` requests. Prints a table and writes JSON (and a PNG with ``--png``).

    python bench/soak.py --requests 1000 --minutes 10 --json runs/soak.json --png runs/soak.png
    python bench/soak.py --requests 40 --minutes 2 --model tiny-qwen3-vl      # a quick check
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.serve import screenshot_requests
from mmkv.serve.process import ServerProcess

BOUNDS = {  # small bounds, so they fill within the first minutes of the run
    "--pool-bytes": str(64 << 20), "--kv-memory-bytes": str(32 << 20), "--encoder-memory-bytes": str(16 << 20),
    "--image-cache-bytes": str(16 << 20), "--decode-budget-bytes": str(256 << 20),
    "--layout-cache-bytes": str(8 << 20),
}  # fmt: skip


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def run(
    model: str, requests: int, minutes: float, concurrency: int, turns: int, window: int, every: int
) -> dict:
    samples, done, errors, dead, lock = [], [0], [0], [False], threading.Lock()
    end = time.monotonic() + 60 * minutes
    with tempfile.TemporaryDirectory() as tmp:
        flags = [x for pair in BOUNDS.items() for x in pair]
        with ServerProcess(
            ["--model", model, "--device", "cpu", "--max-queue", "256", *flags], Path(tmp) / "log"
        ) as server:
            pid, url = server.process.pid, f"{server.base_url}/v1/chat/completions"
            started = time.monotonic()

            def sample() -> None:
                metrics = httpx.get(f"{server.base_url}/metrics", timeout=60).text
                pool = float(re.search(r"^mmkv_pool_bytes (\S+)$", metrics, re.M).group(1))
                samples.append({"requests": done[0], "seconds": round(time.monotonic() - started, 1),
                                "rss_mb": round(rss_mb(pid), 1), "pool_mb": round(pool / 2**20, 1)})  # fmt: skip
                print(f"{done[0]:5d} requests  {samples[-1]['seconds']:7.1f} s  RSS {samples[-1]['rss_mb']:7.1f} MB"
                      f"  pool {samples[-1]['pool_mb']:6.1f} MB", flush=True)  # fmt: skip

            def agent(number: int, wave: int) -> None:
                with httpx.Client(timeout=600) as client:
                    for messages in screenshot_requests(number, turns, window, 5000 + wave):
                        if done[0] >= requests or time.monotonic() > end or dead[0]:
                            return
                        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
                        try:
                            status = client.post(url, json=body).status_code
                        except httpx.HTTPError:  # the server went away: counted, and the run stops
                            status, dead[0] = 0, True
                        with lock:
                            done[0] += 1
                            errors[0] += status != 200
                            if done[0] % every == 0:
                                sample()

            sample()
            wave = 0
            while done[0] < requests and time.monotonic() < end and not dead[0]:
                threads = [threading.Thread(target=agent, args=(k, wave)) for k in range(concurrency)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                wave += 1
            if dead[0]:
                log = (Path(tmp) / "log").read_text(errors="replace").splitlines()
                print("the server went away; its log ends:\n" + "\n".join(log[-60:]), flush=True)
            else:
                sample()
    half = [s["rss_mb"] for s in samples if s["requests"] >= done[0] / 2]
    return {"model": model, "requests": done[0], "errors": errors[0], "server_died": dead[0], "bounds": BOUNDS,
            "samples": samples,
            "rss_second_half_mb": [min(half), max(half)] if half else None}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=4, help="agents at once")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--every", type=int, default=25, help="requests between samples")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    result = run(
        args.model, args.requests, args.minutes, args.concurrency, args.turns, args.window, args.every
    )
    print(f"{result['requests']} requests, {result['errors']} not 200"
          f"{', THE SERVER DIED' if result['server_died'] else ''}; RSS over the second half: "
          f"{result['rss_second_half_mb']} MB")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.png:
        from matplotlib.figure import Figure

        figure = Figure(figsize=(6, 3.2))
        axes = figure.add_subplot()
        xs = [s["requests"] for s in result["samples"]]
        axes.plot(xs, [s["rss_mb"] for s in result["samples"]], label="server RSS (MB)")
        axes.plot(xs, [s["pool_mb"] for s in result["samples"]], label="live-cache pool (MB)")
        axes.set_xlabel("requests answered")
        axes.set_ylabel("MB")
        axes.legend()
        figure.tight_layout()
        args.png.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
