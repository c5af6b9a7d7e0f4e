"""Replicas behind the SMG gateway: 16 desktop agents (tool loops, the history resent with the last screenshots
kept) against one replica, two replicas behind the gateway with the agent policy (``cache_aware``: smg's defaults,
and with its spill gate at +2 requests), and the same two with ``round_robin``; every replica on one
``redis-server``.

Per round the four arms run one after another in a rotating order (A B C D, B C D A, ...), each on episodes new to
every server (a salt per round and arm: no arm is served from another's pool or Redis entries). Per arm: turns/s,
TTFT p50/p90 (client-side, request sent to the first streamed delta), the share of prompt tokens cached (the
pool: prefix and spliced images), the share of images whose KV came from Redis and the busier replica's share of
the requests (how evenly the gateway spread them); medians over rounds with
min-max. **On a 2-core machine two replicas share the cores**: the figure to read is reuse (tokens cached) and
its TTFT effect, not scaling.

Run::

    python bench/gateway.py --model small-qwen3-vl --agents 16 --rounds 2 --json docs/results/gateway-small-qwen3-vl.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve import _desktop_agent, _load
from mmkv.serve.gateway import GatewayProcess
from mmkv.serve.process import ServerProcess, running
from tests.redis_server import RedisServer

ARMS = (
    "one replica",
    "2 replicas, cache_aware",
    "2 replicas, cache_aware, spill at +2",
    "2 replicas, round_robin",
)
# the spill gate tightened: a matched replica is passed over for the least loaded one once it holds 2 requests
# (and 1.2x) more than the mean, instead of smg's 64 (which 16 agents never reach)
SPILL = ("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.2")
METRICS = ("turns_s", "p50_ms", "p90_ms", "cached", "redis_images", "step_accuracy", "busier_share")


def _row(results: list[dict], seconds: float, served: list[int]) -> dict:
    """One arm's run: its metrics (see the module docstring); ``served``: requests each replica answered."""
    ttft = sorted(1e3 * r["ttft"] for r in results)
    sources = [s for r in results for s in r["sources"]]
    return {"turns_s": len(results) / seconds, "p50_ms": ttft[len(ttft) // 2],
            "p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "cached": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
            "redis_images": sources.count("redis") / max(1, len(sources)),
            "step_accuracy": sum(r["right"] for r in results) / len(results), "requests": len(results),
            "busier_share": max(served) / max(1, sum(served)), "served": served}  # fmt: skip


def run(args) -> dict:
    """Every round of every arm; per arm the medians with min-max (and the rounds themselves)."""
    samples: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis_server:
        flags = ["--model", args.model, "--device", "cpu", "--max-queue", "256", "--store", redis_server.url]
        servers = [ServerProcess(flags, Path(tmp) / f"replica{i}.log") for i in range(3)]
        with running(servers):  # the three load their models at once
            alone, pair = servers[0], [s.base_url for s in servers[1:]]
            with GatewayProcess(pair, Path(tmp) / "cache_aware.log") as aware, \
                    GatewayProcess(pair, Path(tmp) / "spill.log", extra=SPILL) as spill, \
                    GatewayProcess(pair, Path(tmp) / "rr.log", policy="round_robin") as rr:  # fmt: skip
                targets = dict(zip(ARMS, (alone, aware, spill, rr), strict=True))
                backends = {arm: [alone] if arm == ARMS[0] else servers[1:] for arm in ARMS}
                for round_ in range(args.rounds):
                    for k, arm in enumerate(ARMS[round_ % 4 :] + ARMS[: round_ % 4]):
                        make = functools.partial(
                            _desktop_agent, model=args.model, window=args.window, max_tokens=args.max_tokens,
                            tool_choice="required", max_steps=args.steps, salt=1 + 4 * round_ + k,
                        )  # fmt: skip
                        before = [s.answered() for s in backends[arm]]
                        results, seconds = asyncio.run(
                            _load(targets[arm], args.model, args.rate, args.agents, make)
                        )
                        samples[arm].append(
                            _row(
                                results,
                                seconds,
                                [s.answered() - n for s, n in zip(backends[arm], before, strict=True)],
                            )
                        )
                        print(f"round {round_} {arm:24s} " + ", ".join(f"{m} {samples[arm][-1][m]:.3g}"
                                                                       for m in METRICS), flush=True)  # fmt: skip
    summary = {arm: {m: {"median": statistics.median(r[m] for r in rows), "min": min(r[m] for r in rows),
                         "max": max(r[m] for r in rows)} for m in METRICS} for arm, rows in samples.items()}  # fmt: skip
    return {"args": vars(args), "summary": summary, "rounds": samples}


def markdown(result: dict) -> str:
    """The table: one row per arm, medians with min-max."""

    def cell(m: dict, fmt: str) -> str:
        return f"{m['median']:{fmt}} ({m['min']:{fmt}}-{m['max']:{fmt}})"

    lines = ["| arm | turns/s | TTFT p50 ms | TTFT p90 ms | prompt tokens cached | images from Redis | step accuracy "
             "| busier replica's share |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, s in result["summary"].items():
        lines.append(f"| {arm} | {cell(s['turns_s'], '.2f')} | {cell(s['p50_ms'], '.0f')} | {cell(s['p90_ms'], '.0f')} "
                     f"| {cell(s['cached'], '.2f')} | {cell(s['redis_images'], '.2f')} | {cell(s['step_accuracy'], '.2f')} | {cell(s['busier_share'], '.2f')} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--rate", type=float, default=8.0, help="agents arriving per second (Poisson)")
    parser.add_argument("--steps", type=int, default=6, help="requests per episode at most")
    parser.add_argument("--window", type=int, default=3, help="screenshots an agent keeps")
    parser.add_argument("--max-tokens", type=int, default=64, help="a call's bound (a call is ~22-48 tokens)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"model {args.model}; load before {os.getloadavg()[0]:.1f}; {os.cpu_count()} cores", flush=True)
    result = run(args)
    result["load_after"] = os.getloadavg()[0]
    print(f"load after {result['load_after']:.1f}")
    print(markdown(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
