"""The server under load: agents acting on the simulated desktop through tool calls, ``kv`` against prefix
reuse only and no reuse.

**Agents** (part 1): agents arrive as a Poisson process at each offered load (agents per second); each runs an
episode of ``mmkv.envs.DesktopApp`` (held-out split) as a computer-use agent does: the policy and the first
screenshot, then per step the model's tool call (streamed), the call executed on the app, the tool result
carrying the next screenshot, the whole history resent with the last ``--window`` screenshots kept (the
assistant messages as the server returned them). An episode ends when the app's queue is empty, after its
step bound, after ``--max-steps`` requests, or on an answer without a call. Three servers, one per arm:

- ``kv``: the pool of live caches, and stored image KV spliced where a screenshot moved;
- ``none``: the pool only (``--reuse none``: what a prefix cache gives, reuse up to the first change);
- ``no reuse``: ``--reuse none --pool-bytes 0`` (everything recomputed).

At each load the arms run one after another in a rotating order (A B C, then B C A, ...; the idle servers wait
without work); every arm runs the same episodes at a load, and each load new ones (new pictures). Per arm and
load: TTFT p50/p90/p99 with min-max over steps (client-side: request sent to the first streamed delta of the
answer; and the server's own queue + first-token time), per-step accuracy, episode success, throughput, the
fraction of prompt tokens cached and where the images' KV came from.

**A mutable field** (part 2, the seed paper's online experiment): agents whose long system policy holds one
field that changes halfway through: the client edits the policy **in place** (the prompt changes at the field)
or appends an **erratum** message (the prompt before it stays the same). Per load: prefix hit rate (cached
tokens / prompt tokens) and p90 TTFT of each.

Run::

    python bench/serve.py --model small-qwen3-vl --loads 0.25 0.5 1 --agents 8 --json runs/serve.json --png runs/serve.png
    python bench/serve.py --model small-qwen3-vl --parts agents --loads 0.5 1   # the tool loops only
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

from mmkv.envs import DesktopApp, FunctionCall, image_data_url, keep_last_screenshots, tool_result_messages
from mmkv.serve.process import ServerProcess, running
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


async def _streamed_step(client: AsyncOpenAI, model: str, messages: list, tools: list, tool_choice: str,
                         max_tokens: int) -> dict:  # fmt: skip
    """One streamed request of a tool loop: the calls assembled from the deltas, the client's time to the first
    delta of the answer, and the server's report (the usage chunk's ``mmkv`` object)."""
    started = time.perf_counter()
    ttft, calls, content, usage, ext = None, {}, [], None, {}
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False,
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - started
            content.append(delta.content or "")
            for piece in delta.tool_calls or ():
                entry = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
        if chunk.usage is not None:
            usage, ext = chunk.usage, (chunk.model_extra or {}).get("mmkv", {})
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started, "calls": [calls[i] for i in sorted(calls)],
            "content": "".join(content) or None, "prompt": usage.prompt_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens, "server_ttft": 1e-3 * (ext["ttft_ms"] + ext["queue_ms"]),
            "sources": [i["source"] for i in ext.get("images", [])], "done": time.perf_counter()}  # fmt: skip


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


async def _desktop_agent(
    client, agent: int, *, model: str, window: int, max_tokens: int, tool_choice: str, max_steps: int,
    salt: int = 0,
) -> list[dict]:  # fmt: skip
    """One agent's episode of the desktop (seed from ``agent`` and ``salt``), each request sent once the
    previous one answered and its call was executed. One record per request; the last carries ``success``."""
    app = DesktopApp("heldout")
    first = app.reset(10_000 * salt + agent)
    tools = app.tools()
    messages = [{"role": "system", "content": app.policy},
                {"role": "user", "content": [{"type": "text", "text": first.text},
                                             {"type": "image_url", "image_url": {"url": image_data_url(first.image)}}]}]  # fmt: skip
    out = []
    while not app.done and len(out) < max_steps:
        expected = app.expected_call()
        result = await _streamed_step(client, model, keep_last_screenshots(messages, window), tools, tool_choice,
                                      max_tokens)  # fmt: skip
        calls = result.pop("calls")
        right = False
        if calls:
            call = calls[0]
            messages.append({"role": "assistant", "content": result["content"], "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})  # fmt: skip
            outcome = app.step(call["name"], _arguments(call["arguments"]))
            right = outcome.is_right and FunctionCall(call["name"], _arguments(call["arguments"])) == expected
            messages += tool_result_messages(call["id"], outcome.text, outcome.image, "tool")
        out.append(result | {"step": len(out), "right": right})
        if not calls:
            break
    out[-1]["success"] = app.success
    return out


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
    server = sorted(r["server_ttft"] for r in results if "server_ttft" in r)
    episodes = [r["success"] for r in results if "success" in r]
    steps = [r["right"] for r in results if "right" in r]
    return {
        "requests": len(results), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
        "min_ms": 1e3 * ttft[0], "max_ms": 1e3 * ttft[-1],
        "server_p50_ms": 1e3 * server[len(server) // 2] if server else None,
        "server_p90_ms": 1e3 * server[min(len(server) - 1, int(0.9 * len(server)))] if server else None,
        "step_accuracy": sum(steps) / len(steps) if steps else None,
        "episodes": len(episodes), "episode_success": sum(episodes) / len(episodes) if episodes else None,
        "throughput_rps": len(results) / seconds,
        "cached_fraction": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
        "sources": {s: sources.count(s) / max(1, len(sources)) for s in sorted(set(sources))},
    }  # fmt: skip


def _line(row: dict) -> str:
    """A summary row as one printed line."""
    line = (f"TTFT p50 {row['p50_ms']:.0f} p90 {row['p90_ms']:.0f} ms [{row['min_ms']:.0f}-{row['max_ms']:.0f}], "
            f"{row['requests']} requests, cached {row['cached_fraction']:.2f}, sources {row['sources']}")  # fmt: skip
    if row.get("episode_success") is not None:
        line += f", step accuracy {row['step_accuracy']:.2f}, episode success {row['episode_success']:.2f}"
    return line


def run(args) -> dict:
    """Every part at every load (see the module docstring); the summaries by part, arm and load."""
    out: dict = {"model": args.model, "loads": args.loads, "window": args.window, "agents": {}, "fields": {}}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {name: ServerProcess(["--model", args.model, "--device", "cpu", "--max-queue", "256", *flags],
                                       Path(tmp) / f"{name.replace(' ', '_')}.log")  # fmt: skip
                   for name, flags in ARMS.items()}  # fmt: skip
        with running(list(servers.values())):  # the three load their models at once
            names = list(ARMS)
            for index, rate in enumerate(args.loads):
                for name in names[index % 3 :] + names[: index % 3] if "agents" in args.parts else ():
                    make = functools.partial(
                        _desktop_agent, model=args.model, window=args.window, max_tokens=args.max_tokens,
                        tool_choice=args.tool_choice, max_steps=args.max_steps, salt=index,
                    )  # fmt: skip
                    results, seconds = asyncio.run(_load(servers[name], args.model, rate, args.agents, make))
                    out["agents"].setdefault(name, []).append(_summary(results, seconds) | {"load": rate})
                    print(f"agents load {rate}/s {name:9s}", _line(out["agents"][name][-1]), flush=True)
                modes = ("in place", "erratum") if index % 2 == 0 else ("erratum", "in place")
                for mode in modes if "fields" in args.parts else ():
                    salt = 10 * index + 1 + (mode == "erratum")  # each mode's agents new to the server
                    make = functools.partial(_field_agent, model=args.model, turns=args.turns, mode=mode,
                                             max_tokens=args.field_max_tokens, salt=salt)  # fmt: skip
                    results, seconds = asyncio.run(_load(servers["kv"], args.model, rate, args.agents, make))
                    after = [r for r in results if r["after_change"]]
                    row = _summary(results, seconds) | {
                        "load": rate,
                        "after_change": _summary(after, seconds),
                    }
                    out["fields"].setdefault(mode, []).append(row)
                    print(f"field load {rate}/s {mode:9s}", json.dumps(row["after_change"]), flush=True)
    return out


def markdown(result: dict) -> str:
    """The agents' table: one row per load and arm."""
    lines = ["| load (agents/s) | arm | steps | TTFT p50 ms | TTFT p90 ms | min-max ms | server p50 ms | step accuracy "
             "| episode success | prompt cached | images spliced |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for load in result["loads"]:
        for arm, rows in result["agents"].items():
            for r in (r for r in rows if r["load"] == load):
                lines.append(
                    f"| {load:g} | {arm} | {r['requests']} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | "
                    f"{r['min_ms']:.0f}-{r['max_ms']:.0f} | {r['server_p50_ms']:.0f} | {r['step_accuracy']:.2f} | "
                    f"{r['episode_success']:.2f} ({r['episodes']}) | {r['cached_fraction']:.2f} | "
                    f"{sum(v for k, v in r['sources'].items() if k in ('memory', 'disk', 'redis')):.2f} |"
                )  # fmt: skip
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 3.6), layout="constrained")
    left, middle, right = figure.subplots(1, 3)
    for name, rows in result["agents"].items():
        loads = [r["load"] for r in rows]
        left.plot(loads, [r["p90_ms"] for r in rows], marker="o", label=f"{name} p90")
        left.plot(loads, [r["p50_ms"] for r in rows], marker=".", linestyle=":", label=f"{name} p50")
        middle.plot(loads, [r["cached_fraction"] for r in rows], marker="o", label=name)
    for mode, rows in result["fields"].items():
        right.plot(
            [r["load"] for r in rows], [r["after_change"]["p90_ms"] for r in rows], marker="o", label=mode
        )
    left.set(title="desktop agents: TTFT per step", xlabel="agents / s", ylabel="ms", yscale="log")
    middle.set(title="desktop agents: prompt tokens cached", xlabel="agents / s", ylim=(0, 1))
    right.set(title="field change: p90 TTFT after it", xlabel="agents / s", ylabel="ms")
    for axes in (left, middle, right):
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
        else:  # a part not run (--parts)
            axes.text(0.5, 0.5, "not run", ha="center", va="center", transform=axes.transAxes)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/serve.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument(
        "--loads", type=float, nargs="+", default=[0.25, 0.5, 1], help="agents arriving per second"
    )
    parser.add_argument("--agents", type=int, default=8, help="agents per load and arm")
    parser.add_argument("--parts", nargs="+", choices=["agents", "fields"], default=["agents", "fields"])
    parser.add_argument("--window", type=int, default=3, help="screenshots an agent keeps")
    parser.add_argument("--tool-choice", choices=["auto", "required"], default="auto")
    parser.add_argument("--max-steps", type=int, default=20, help="requests per episode at most")
    parser.add_argument("--max-tokens", type=int, default=96, help="an answer's bound (a call is ~22 tokens)")
    parser.add_argument("--turns", type=int, default=12, help="turns of a field agent")
    parser.add_argument("--field-max-tokens", type=int, default=8)
    parser.add_argument(
        "--smoke", action="store_true",
        help="tiny-qwen3-vl, two loads, two agents of three steps (calls forced, 48 tokens at most), window 2",
    )  # fmt: skip
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.loads, args.agents, args.window = "tiny-qwen3-vl", [2.0, 4.0], 2, 2
        args.turns, args.max_steps, args.tool_choice, args.max_tokens = 3, 3, "required", 48
    result = run(args)
    if result["agents"]:
        print(markdown(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        plot(result, args.png)
