"""The server under load: simulated agents over the OpenAI API, ``kv`` against prefix reuse only and no reuse.

**Screenshots** (part 1): agents arrive as a Poisson process at each offered load (agents per second); each runs
a ``--turns``-turn computer-use trajectory (a new screenshot per turn, a window of the last ``--window``,
resending its whole history each turn, as agents do), streaming every answer. Three servers, one per arm:

- ``kv``: the pool of live caches, and stored image KV spliced where a screenshot moved;
- ``none``: the pool only (what a prefix cache gives: reuse up to the first change);
- ``no reuse``: ``--reuse none --pool-bytes 0`` (everything recomputed).

At each load the arms run one after another in a rotating order (A B C, then B C A, ...; the idle servers wait
without work). Per arm and load: TTFT p50/p90/p99 (client-side, request sent to first streamed token),
throughput, the fraction of prompt tokens cached, and where the images' KV came from.

**A mutable field** (part 2, the seed paper's online experiment): agents whose long system policy holds one
field that changes halfway through: the client edits the policy **in place** (the prompt changes at the field)
or appends an **erratum** message (the prompt before it stays the same). Per load: prefix hit rate (cached
tokens / prompt tokens) and p90 TTFT of each.

Run::

    python bench/serve.py --model small-qwen3-vl --loads 0.5 1 2 4 --json runs/serve.json --png runs/serve.png
    python bench/serve.py --smoke        # a few requests on tiny-qwen3-vl (the test suite runs it)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openai import AsyncOpenAI

from mmkv.serve.process import ServerProcess
from mmkv.synthetic import synthetic_screenshot

ARMS = {"kv": [], "none": ["--reuse", "none"], "no reuse": ["--reuse", "none", "--pool-bytes", "0"]}
POLICY = (
    "You are the operations agent of a ticketing desk. Policy: account_role is {role}. "
    + "Follow the escalation rules exactly; approve only what your role allows; log every action. " * 12
)


def _shot(agent: int, turn: int) -> str:
    buffer = io.BytesIO()
    synthetic_screenshot(10_000 * agent + turn, (448, 336)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def _request(client: AsyncOpenAI, model: str, messages: list, max_tokens: int) -> dict:
    started = time.perf_counter()
    ttft, text, usage, ext = None, [], None, {}
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None and ttft is None:
            ttft = time.perf_counter() - started
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage, ext = chunk.usage, (chunk.model_extra or {}).get("mmkv", {})
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started, "text": "".join(text),
            "prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens,
            "sources": [i["source"] for i in ext.get("images", [])], "done": time.perf_counter()}  # fmt: skip


def screenshot_requests(agent: int, turns: int, window: int, salt: int = 0):
    """The messages of each of one agent's requests: the whole history, with only its last ``window``
    screenshots; ``salt`` (a load's index) makes the screenshots new to a server that served earlier loads."""
    steps = []
    for turn in range(turns):
        steps.append((turn, _shot(agent + 1000 * salt, turn)))
        messages = [{"role": "system", "content": "You operate a desktop app. Reply with one tool call."}]
        for number, (t, url) in enumerate(steps):
            content = [{"type": "text", "text": f"Step {t}: here is the screen."}]
            if number >= len(steps) - window:  # the agent keeps only its last `window` screenshots
                content.append({"type": "image_url", "image_url": {"url": url}})
            messages.append({"role": "user", "content": content})
            if t < turn:
                messages.append({"role": "assistant", "content": f"click(button_{t})"})
        yield messages


async def _screenshot_agent(
    client, agent: int, *, model: str, turns: int, window: int, max_tokens: int, salt: int = 0
) -> list[dict]:
    """One agent's trajectory (``screenshot_requests``), each request sent once the previous one answered."""
    return [
        await _request(client, model, messages, max_tokens)
        for messages in screenshot_requests(agent, turns, window, salt)
    ]


async def _field_agent(
    client, agent: int, *, model, turns: int, mode: str, max_tokens: int, salt: int = 0
) -> list[dict]:
    messages = [{"role": "system", "content": POLICY.format(role="admin")}]
    out = []
    for turn in range(turns):
        if turn == turns // 2:  # the field changes
            if mode == "in place":
                messages[0] = {"role": "system", "content": POLICY.format(role="viewer")}
            else:
                messages.append({"role": "system", "content": "[STATE UPDATE] account_role has just changed to "
                                 "viewer; this overrides any earlier value. Apply the current value."})  # fmt: skip
        text = (
            f"Ticket {salt}-{agent}-{turn}: a red status badge. What now?"  # new to the server at each load
        )
        messages.append({"role": "user", "content": text})
        result = await _request(client, model, messages, max_tokens)
        out.append(result | {"after_change": turn >= turns // 2})
        messages.append({"role": "assistant", "content": result["text"]})
    return out


async def _load(
    server: ServerProcess, model: str, rate: float, agents: int, make
) -> tuple[list[dict], float]:
    """``agents`` agents arriving as a Poisson process of ``rate`` per second; all their requests."""
    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(int(rate * 1000) + agents)
    started = time.perf_counter()

    async def delayed(agent: int, delay: float):
        await asyncio.sleep(delay)
        return await make(client, agent)

    delays, t = [], 0.0
    for _ in range(agents):
        delays.append(t)
        t += rng.expovariate(rate)
    results = await asyncio.gather(*(delayed(a, d) for a, d in enumerate(delays)))
    await client.close()
    return [r for agent in results for r in agent], time.perf_counter() - started


def _summary(results: list[dict], seconds: float) -> dict:
    ttft = sorted(r["ttft"] for r in results)

    def q(p: float) -> float:
        return 1e3 * ttft[min(len(ttft) - 1, int(p * len(ttft)))]

    sources = [s for r in results for s in r["sources"]]
    return {
        "requests": len(results), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
        "throughput_rps": len(results) / seconds,
        "cached_fraction": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
        "sources": {s: sources.count(s) / max(1, len(sources)) for s in sorted(set(sources))},
    }  # fmt: skip


def run(args) -> dict:
    out: dict = {"model": args.model, "loads": args.loads, "screenshots": {}, "fields": {}}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {name: ServerProcess(["--model", args.model, "--device", "cpu", "--max-queue", "256", *flags],
                                       Path(tmp) / f"{name.replace(' ', '_')}.log")  # fmt: skip
                   for name, flags in ARMS.items()}  # fmt: skip
        for server in servers.values():
            server.__enter__()
        try:
            names = list(ARMS)
            for index, rate in enumerate(args.loads):
                for name in names[index % 3 :] + names[: index % 3]:
                    make = functools.partial(_screenshot_agent, model=args.model, turns=args.turns,
                                             window=args.window, max_tokens=args.max_tokens, salt=index)  # fmt: skip
                    results, seconds = asyncio.run(_load(servers[name], args.model, rate, args.agents, make))
                    out["screenshots"].setdefault(name, []).append(
                        _summary(results, seconds) | {"load": rate}
                    )
                    print(f"screenshots load {rate}/s {name:9s}", json.dumps(out["screenshots"][name][-1]))
                for mode in ("in place", "erratum") if index % 2 == 0 else ("erratum", "in place"):
                    salt = 10 * index + 1 + (mode == "erratum")  # each mode's agents new to the server
                    make = functools.partial(_field_agent, model=args.model, turns=args.turns, mode=mode,
                                             max_tokens=args.max_tokens, salt=salt)  # fmt: skip
                    results, seconds = asyncio.run(_load(servers["kv"], args.model, rate, args.agents, make))
                    after = [r for r in results if r["after_change"]]
                    row = _summary(results, seconds) | {
                        "load": rate,
                        "after_change": _summary(after, seconds),
                    }
                    out["fields"].setdefault(mode, []).append(row)
                    print(f"field load {rate}/s {mode:9s}", json.dumps(row["after_change"]))
        finally:
            for server in servers.values():
                server.__exit__(None, None, None)
    return out


def plot(result: dict, path: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 3.6), layout="constrained")
    left, middle, right = figure.subplots(1, 3)
    for name, rows in result["screenshots"].items():
        loads = [r["load"] for r in rows]
        left.plot(loads, [r["p90_ms"] for r in rows], marker="o", label=name)
        middle.plot(loads, [r["cached_fraction"] for r in rows], marker="o", label=name)
    for mode, rows in result["fields"].items():
        right.plot(
            [r["load"] for r in rows], [r["after_change"]["p90_ms"] for r in rows], marker="o", label=mode
        )
    left.set(title="screenshots: p90 TTFT", xlabel="agents / s", ylabel="ms", yscale="log")
    middle.set(title="screenshots: prompt tokens cached", xlabel="agents / s", ylim=(0, 1))
    right.set(title="field change: p90 TTFT after it", xlabel="agents / s", ylabel="ms")
    for axes in (left, middle, right):
        axes.legend()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/serve.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument(
        "--loads", type=float, nargs="+", default=[0.5, 1, 2, 4], help="agents arriving per second"
    )
    parser.add_argument("--agents", type=int, default=8, help="agents per load and arm")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny-qwen3-vl, two loads, two agents, three turns, window 2"
    )
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.loads, args.agents, args.turns, args.window = "tiny-qwen3-vl", [2.0, 4.0], 2, 3, 2
    result = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        plot(result, args.png)
