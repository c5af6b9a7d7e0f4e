"""Where a server request's time goes, in process, and whether any step grows with the server's history.

The server's own ``Engine`` per arm (``kv``; ``none`` = the pool's prefix reuse only; no reuse = no pool), the
model worker's steps timed one by one, over waves of agents (each wave new content: ``bench/serve.py``'s
screenshot trajectories, ``screenshot_requests``, one request at a time), the arms interleaved wave by wave (kv, none, no reuse, kv,
...). Per wave and arm, the mean ms per request of: building the conversation from the request (images decoded,
or found by the hash of their bytes), the layout, the pool checkout, the turn (and the forward inside it),
decoding ``--max-tokens`` tokens and the check-in; the time in Python's garbage collector; the idle pool
entries. A step whose time climbs wave after wave grows with the server's history (the pool scan and the
check-in's byte sum did, before they were fixed).

    python bench/serve_parts.py --waves 6 --agents 4
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import bench.serve as serve_bench
from mmkv.prompt.blocks import LayoutBuilder
from mmkv.runtime import GREEDY, TurnPolicy, TurnSources, generate, run_turn
from mmkv.serve import Engine, ServerConfig
from mmkv.serve.schema import ChatCompletionRequest

STEPS = ("conversation", "layout", "checkout", "turn", "forward", "decode", "checkin")


class GcClock:
    """Seconds spent in Python's garbage collector since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds, self._started = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


def one_request(engine: Engine, model: str, messages: list, max_tokens: int) -> dict[str, float]:
    """The worker's steps for one request, each timed (seconds)."""
    t0 = time.perf_counter()
    body = ChatCompletionRequest.model_validate(
        {"model": model, "messages": messages, "max_tokens": max_tokens}
    )
    conversation = engine.conversation(body)
    t1 = time.perf_counter()
    layout = LayoutBuilder(engine.handle).build(conversation, add_generation_prompt=True)
    t2 = time.perf_counter()
    live, _ = engine.pool.checkout(layout)
    t3 = time.perf_counter()
    policy = TurnPolicy(engine.config.reuse, engine.config.seam)
    with torch.inference_mode():
        sources = TurnSources(
            engine.handle, engine.kv_store, engine.encoder_store, policy.reuse, engine.pixels
        )
        logits, stats = run_turn(engine.handle, live, layout, conversation.images, sources, policy, t3)
        t4 = time.perf_counter()
        for _ in generate(engine.handle, live, logits, max_tokens, GREEDY):
            pass
    t5 = time.perf_counter()
    engine.pool.checkin(live)
    t6 = time.perf_counter()
    times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, stats.forward_seconds, t5 - t4, t6 - t5)
    return dict(zip(STEPS, times, strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--agents", type=int, default=4, help="agents per wave, one after another")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    arms = {"kv": {}, "none": {"reuse": "none"}, "no reuse": {"reuse": "none", "pool_bytes": 0}}
    engines = {name: Engine(ServerConfig(model=args.model, device="cpu", **kw)) for name, kw in arms.items()}
    clock = GcClock()
    for wave in range(args.waves):
        for name, engine in engines.items():
            totals, count, clock.seconds = dict.fromkeys(STEPS, 0.0), 0, 0.0
            for agent in range(args.agents):
                for messages in serve_bench.screenshot_requests(agent, args.turns, args.window, 100 + wave):
                    for step, seconds in one_request(engine, args.model, messages, args.max_tokens).items():
                        totals[step] += seconds
                    count += 1
            cells = " ".join(f"{step} {1e3 * total / count:6.1f}" for step, total in totals.items())
            print(f"wave {wave} {name:8s} {cells} gc {1e3 * clock.seconds / count:5.1f} "
                  f"entries {engine.pool.num_entries}", flush=True)  # fmt: skip
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
