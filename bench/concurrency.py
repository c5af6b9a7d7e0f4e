"""Many agents at once: closed-loop and Poisson agents against the batching engine, ``--max-batch 1`` (one request
at a time) and batched ``none``.

Arms, one ``mmkv serve`` each, started once and run in a rotating order per round (A B C, B C A, ...; the idle
servers wait without work):

- ``kv``: the batching engine (``--max-batch 8`` by default), image KV spliced where a screenshot moved;
- ``kv, max-batch 1``: the same server one request at a time (the engine before batching);
- ``none``: the batching engine with ``--reuse none`` (the pool only: what a prefix cache gives).

Workloads: ``text``, 10-turn trajectories (a new screenshot per turn, the last 3 kept, the history resent,
answers streamed as text, ``--text-tokens`` each); ``tools``, episodes of the simulated desktop (tool calls of
the desktop's tools with ``tool_choice=required``, tool results carrying the next screenshot; ~48-token calls).
Closed loop: N agents, each sending its next request when the previous one answered; Poisson: agents arriving
at a rate, each running one trajectory. Every arm at a (workload, load, round) gets the same new pictures.
Per arm: TTFT p50 / p90 (client: request sent to the first streamed delta), turns/s (requests answered over
the wall time of the load), with min-max over rounds. ``transformers serve`` is not an arm here: the CLI needs
the ``transformers[serving]`` extras, which this project does not install.

Run::

    python bench/concurrency.py --model small-qwen3-vl --agents 1 2 4 8 16 --rates 0.5 1 2 --rounds 2 \\
        --json docs/results/concurrency-small-qwen3-vl.json --png docs/results/concurrency-small-qwen3-vl.png
    python bench/concurrency.py --workloads tools --agents 1 8 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openai import AsyncOpenAI

from bench.serve import _desktop_agent, _request, screenshot_requests
from mmkv.serve.process import ServerProcess

ARMS = {"kv": [], "kv, max-batch 1": ["--max-batch", "1"], "none": ["--reuse", "none"]}


async def _text_agent(client, agent: int, model: str, salt: int, turns: int, tokens: int) -> list[dict]:
    out, history = [], None
    for messages in screenshot_requests(agent, turns, 3, salt):
        started = time.perf_counter()
        result = await _request(client, model, messages, tokens)
        out.append({"ttft": result["ttft"], "done": time.perf_counter(), "started": started})
        history = messages
    del history
    return out


async def _tool_agent(client, agent: int, model: str, salt: int, max_steps: int) -> list[dict]:
    steps = await _desktop_agent(client, agent, model=model, window=3, max_tokens=64, tool_choice="required",
                                 max_steps=max_steps, salt=salt)  # fmt: skip
    return [{"ttft": s["ttft"], "done": s["done"], "right": s["right"]} for s in steps]


async def _run_load(server: ServerProcess, model: str, workload: str, agents: int, rate: float | None,
                    salt: int, args) -> dict:  # fmt: skip
    """``agents`` agents at once (closed loop), or arriving at ``rate`` per second (Poisson); all requests."""
    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(salt)

    async def one(k: int, delay: float):
        await asyncio.sleep(delay)
        if workload == "text":
            return await _text_agent(client, 1000 * salt + k, model, salt, args.turns, args.text_tokens)
        return await _tool_agent(client, 1000 * salt + k, model, salt, args.turns)

    delays, t = [], 0.0
    for _ in range(agents):
        delays.append(t if rate else 0.0)
        t += rng.expovariate(rate) if rate else 0.0
    started = time.perf_counter()
    results = await asyncio.gather(*(one(k, d) for k, d in enumerate(delays)))
    wall = time.perf_counter() - started
    await client.close()
    records = [r for agent in results for r in agent]
    ttfts = sorted(r["ttft"] for r in records)
    return {"ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "turns_s": len(records) / wall, "requests": len(records)}  # fmt: skip


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def bench(args) -> dict:
    loads = [("closed", n, None) for n in args.agents] + [("poisson", args.poisson_agents, r) for r in args.rates]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for i, (arm, extra) in enumerate(ARMS.items()):
                server = ServerProcess(["--model", args.model, "--device", "cpu", "--max-queue", "64", *extra],
                                       Path(tmp) / f"arm{i}.log")  # fmt: skip
                server.__enter__()
                servers[arm] = server
            salt = 0
            for workload in args.workloads:
                for kind, agents, rate in loads:
                    key = f"{workload} {kind} {agents if kind == 'closed' else rate}"
                    samples = {arm: [] for arm in ARMS}
                    for r in range(args.rounds):
                        salt += 1
                        order = list(ARMS)[r % 3 :] + list(ARMS)[: r % 3]
                        for arm in order:
                            samples[arm].append(await _run_load(servers[arm], args.model, workload, agents, rate,
                                                                salt, args))  # fmt: skip
                    results[key] = {arm: {m: _summary([s[m] for s in runs]) for m in ("ttft_p50", "ttft_p90", "turns_s")}
                                    for arm, runs in samples.items()}  # fmt: skip
                    _print(key, results[key])
        finally:
            for server in servers.values():
                server.__exit__(None, None, None)
    return results


def _print(key: str, row: dict) -> None:
    cells = []
    for arm, m in row.items():
        cells.append(f"{arm}: TTFT p50 {1e3 * m['ttft_p50']['median']:6.0f} ms "
                     f"({1e3 * m['ttft_p50']['min']:.0f}-{1e3 * m['ttft_p50']['max']:.0f}), "
                     f"{m['turns_s']['median']:5.2f} turns/s ({m['turns_s']['min']:.2f}-{m['turns_s']['max']:.2f})")  # fmt: skip
    print(f"{key:22s} | " + " | ".join(cells), flush=True)


def _figure(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({k.split()[0] for k in results})
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        keys = [k for k in results if k.startswith(workload + " closed")]
        xs = [int(k.split()[-1]) for k in keys]
        for arm in ARMS:
            p50 = [1e3 * results[k][arm]["ttft_p50"]["median"] for k in keys]
            p90 = [1e3 * results[k][arm]["ttft_p90"]["median"] for k in keys]
            line = axes[row][0].plot(xs, p50, marker="o", label=f"{arm} p50")[0]
            axes[row][0].plot(xs, p90, ls="--", color=line.get_color(), label=f"{arm} p90")
            axes[row][1].plot(xs, [results[k][arm]["turns_s"]["median"] for k in keys], marker="o", label=arm)
        axes[row][0].set(xscale="log", yscale="log", xlabel="agents (closed loop)", ylabel="TTFT ms",
                         title=f"{workload}: time to first token")  # fmt: skip
        axes[row][1].set(xscale="log", xlabel="agents (closed loop)", ylabel="turns/s", title=f"{workload}: throughput")
        for ax in axes[row]:
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--workloads", nargs="+", choices=["text", "tools"], default=["text", "tools"])
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rates", type=float, nargs="*", default=[0.5, 1, 2], help="Poisson agents/s")
    parser.add_argument("--poisson-agents", type=int, default=8, help="agents per Poisson load")
    parser.add_argument("--turns", type=int, default=10, help="turns per trajectory (tool episodes: at most)")
    parser.add_argument("--text-tokens", type=int, default=16, help="a text answer's bound")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args()
    print(f"model {args.model}; load before {os.getloadavg()[0]:.1f}; {os.cpu_count()} cores", flush=True)
    results = asyncio.run(bench(args))
    print(f"load after {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.png:
        _figure(results, args.png)


if __name__ == "__main__":
    main()
