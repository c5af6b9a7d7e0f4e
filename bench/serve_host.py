"""A server request's host time (everything but the model's forward calls) as a resent conversation grows.

An agent resends its whole history every turn (a new screenshot per turn, the last ``--window`` kept, the
earlier answers as text). Each request goes through the real server app in process (FastAPI over ASGI: body
parsing, validation, the conversation, the layout, the pool, the turn, decoding, the response), and the model's
forward calls (the language model and the vision tower) are timed by a wrapper around them; host time is the
request's wall time minus that. Reported per turn (median over ``--agents`` conversations, each new to the
server): host ms, forward ms, and the host ms at turns 2, 10 and 40 the hot-path issue names. ``--parts`` also
times the server's own steps (their host ms per request, forward calls inside them excluded): reading the new
images, the rest of the intake, the layout, the pool's checkout and check-in, the turn, decoding; what is left is
the in-process client and transport (timed apart: the same body posted to a route that answers 404), JSON,
validation, the reply and the hand-offs between threads.

    python bench/serve_host.py --turns 40 --agents 3 --json runs/serve_host.json
    python bench/ab.py --trees /tmp/before . --rounds 3 --keys host_ms -- bench/serve_host.py --json {json}
    python bench/serve_host.py --turns 30 --agents 2 --parts      # where a request's host time goes

Works against any tree that has ``mmkv.serve.Engine`` and ``mmkv.serve.app.create_app`` (so ``bench/ab.py``
can run it before and after a change).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from starlette.testclient import TestClient

from bench.serve import screenshot_requests
from mmkv.serve import Engine, ServerConfig
from mmkv.serve.app import create_app

REPORTED = (2, 10, 40)  # turns the hot-path issue names (1-based)


class ForwardClock:
    """Seconds spent inside the wrapped modules' forward calls (nested calls counted once)."""

    def __init__(self, *modules) -> None:
        self.seconds, self._depth, self._started = 0.0, 0, 0.0
        for module in modules:
            module.forward = self._timed(module.forward)

    def _timed(self, forward):
        @functools.wraps(forward)
        def timed(*args, **kwargs):
            if self._depth == 0:
                self._started = time.perf_counter()
            self._depth += 1
            try:
                return forward(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - self._started

        return timed


class StepClock:
    """Host ms spent in named functions (``obj.attr`` replaced by a timed wrapper), the forward calls inside them
    (``clock``) subtracted. Only for trees that have these steps (``--parts``)."""

    def __init__(self, clock: ForwardClock) -> None:
        self.clock, self.ms = clock, {}
        self._local = (
            threading.local()
        )  # per thread: for each open block, seconds its timed inner blocks took

    @contextlib.contextmanager
    def _measured(self, name: str):
        """Add the host ms of the block (its forward calls and any timed block inside it excluded, so nested
        steps are counted once, in the innermost) to ``name``."""
        children = self._local.__dict__.setdefault("children", [])
        forward, started = self.clock.seconds, time.perf_counter()
        children.append(0.0)
        try:
            yield
        finally:
            inner = children.pop()
            spent = time.perf_counter() - started - (self.clock.seconds - forward)
            self.ms[name] = self.ms.get(name, 0.0) + 1e3 * (spent - inner)
            if children:
                children[-1] += spent

    def wrap(self, name: str, owner, attr: str) -> None:
        function = getattr(owner, attr)

        @functools.wraps(function)
        def timed(*args, **kwargs):
            with self._measured(name):
                return function(*args, **kwargs)

        setattr(owner, attr, timed)

    def wrap_generator(self, name: str, owner, attr: str) -> None:
        function = getattr(owner, attr)

        @functools.wraps(function)
        def timed(*args, **kwargs):
            with self._measured(name):
                yield from function(*args, **kwargs)

        setattr(owner, attr, timed)


MODEL_THREAD = (
    "[model thread] "  # the parts run on the engine's thread (the rest: request threads, event loop)
)


def _time_steps(engine, clock: ForwardClock) -> StepClock:
    from mmkv.engine import DecodeBatch, EngineCore, ModelRunner, Scheduler
    from mmkv.prompt.blocks import LayoutBuilder
    from mmkv.serve.pool import LivePool

    steps = StepClock(clock)
    steps.wrap("new images (decode, digest, preprocess)", type(engine), "_image")
    steps.wrap("intake (request -> conversation)", type(engine), "intake")
    steps.wrap("layout", LayoutBuilder, "build")
    steps.wrap("prepare (size check, engine request)", type(engine), "prepare")
    m = MODEL_THREAD
    steps.wrap(m + "engine step (the rest: bookkeeping, events)", EngineCore, "step")
    steps.wrap(m + "schedule", Scheduler, "schedule")
    steps.wrap(m + "pool checkout", LivePool, "checkout")
    steps.wrap(m + "pool check-in", LivePool, "checkin")
    steps.wrap(m + "prefill (plan, splice, mask, store writes)", ModelRunner, "prefill")
    steps.wrap(m + "decode forward's inputs", ModelRunner, "decode")
    steps.wrap(m + "batch join / leave", DecodeBatch, "join")
    steps.wrap(m + "batch join / leave", DecodeBatch, "leave")
    steps.wrap(m + "decode loop (choose, text)", EngineCore, "_advance")
    return steps


def run(model: str, turns: int, agents: int, window: int, max_tokens: int, parts: bool = False) -> dict:
    """Per turn: medians over the agents of host and forward ms (and with ``parts``, each step's mean host ms
    per request, over the turns after the first ten)."""
    engine = Engine(ServerConfig(model=model, device="cpu"))
    inner = engine.handle.model
    clock = ForwardClock(inner, inner.model.visual)
    steps = _time_steps(engine, clock) if parts else None
    counted, host_after, totals = 0, 0.0, {}
    host: dict[int, list[float]] = {t: [] for t in range(1, turns + 1)}
    forward: dict[int, list[float]] = {t: [] for t in range(1, turns + 1)}
    with TestClient(create_app(engine)) as client:
        warm = next(iter(screenshot_requests(10_000, 1, window, 999)))
        client.post("/v1/chat/completions", json={"model": model, "messages": warm, "max_tokens": 2})
        for agent in range(agents):
            for turn, messages in enumerate(screenshot_requests(agent, turns, window, 77), start=1):
                body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                clock.seconds = 0.0
                before = dict(steps.ms) if steps is not None else {}
                started = time.perf_counter()
                reply = client.post("/v1/chat/completions", json=body)
                wall = time.perf_counter() - started
                assert reply.status_code == 200, reply.text
                host[turn].append(1e3 * (wall - clock.seconds))
                if turn > 10:
                    counted, host_after = counted + 1, host_after + 1e3 * (wall - clock.seconds)
                    for name, ms in (steps.ms if steps is not None else {}).items():
                        totals[name] = totals.get(name, 0.0) + ms - before.get(name, 0.0)
                forward[turn].append(1e3 * clock.seconds)
        floor = []  # the in-process client and transport alone: the last body posted to a route that 404s
        for _ in range(20 if steps is not None else 0):
            started = time.perf_counter()
            client.post("/v1/no-such-route", json=body)
            floor.append(1e3 * (time.perf_counter() - started))
    engine.close()
    med = {t: statistics.median(v) for t, v in host.items()}
    result = {
        "host_ms": {str(t): round(med[t], 3) for t in REPORTED if t in med},
        "host_ms_by_turn": [round(med[t], 3) for t in sorted(med)],
        "forward_ms_by_turn": [round(statistics.median(forward[t]), 3) for t in sorted(forward)],
    }
    if steps is not None and counted:
        # nested steps are counted once, in the innermost (the intake's new images apart from the intake)
        part_ms = {name: ms / counted for name, ms in totals.items()}
        part_ms["rest of the intake (conversation, tools, options)"] = part_ms.pop(
            "intake (request -> conversation)", 0.0
        )
        rest, transport = host_after / counted - sum(part_ms.values()), statistics.median(floor)
        part_ms["client and transport (a 404 of the same body)"] = transport
        part_ms["JSON, validation, replies, thread hand-offs (the rest)"] = rest - transport
        result["parts_ms"] = {name: round(ms, 3) for name, ms in part_ms.items()}
        result["model_thread_ms"] = round(
            sum(ms for n, ms in part_ms.items() if n.startswith(MODEL_THREAD)), 3
        )
        result["parts_host_ms"] = round(host_after / counted, 3)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--agents", type=int, default=3, help="conversations, one after another")
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--parts", action="store_true", help="also time the server's steps (this tree only)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args.model, args.turns, args.agents, args.window, args.max_tokens, args.parts)
    for t, (h, f) in enumerate(zip(result["host_ms_by_turn"], result["forward_ms_by_turn"], strict=True), 1):
        if t in REPORTED or t % 5 == 0:
            print(f"turn {t:3d}: host {h:7.2f} ms   forward {f:7.2f} ms", flush=True)
    if "parts_ms" in result:
        print(f"host ms per request after turn 10, by step (mean; {result['parts_host_ms']:.2f} in all, "
              f"{result['model_thread_ms']:.2f} on the model thread):")  # fmt: skip
        for name, ms in result["parts_ms"].items():
            print(f"  {name:52s} {ms:6.2f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
