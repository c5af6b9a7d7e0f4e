"""Decode throughput of the engine's batch against the headroom plain transformers gives, and the engine's own
work per decode step.

At each batch size B (running sequences), three arms, interleaved per round (A B C, B C A, ...) in this one
process:

- ``engine``: B requests with ~``--context``-token prompts through one ``EngineCore`` (``max_batch`` B), the
  decode phase timed from the step where all B run to the last token (``--tokens`` each; the end of turn is
  biased away so every answer has its full length);
- ``one at a time``: the same requests through ``max_batch`` 1 (today's single-sequence server);
- ``transformers``: the headroom: one forward per step over a batch of B equal-length ``DynamicCache`` s of
  ``--context`` entries, no mmkv at all.

Prints tokens/s (median, min-max over rounds) per arm and B, the engine's share of the headroom, the padding
its rows carried, and the engine's host work per decode step (the step's time minus its forward's) at each B.

Run::

    python bench/batch.py --model small-qwen3-vl --sizes 1 4 8 16 --rounds 3 --json runs/batch.json
    python bench/batch.py --arch qwen2.5-vl-7b --lm-layers 2 --vision-layers 2 --sizes 1 4 8 --rounds 2
    python bench/batch.py --device cuda --dtype bfloat16 ...          # unchanged on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import DynamicCache

from bench.models import add_model_arguments, load_model
from mmkv.cache import EncoderStore, KVStore
from mmkv.compat import cache_argument_name
from mmkv.conversation import Conversation
from mmkv.engine import EngineConfig, EngineCore, Request, Status
from mmkv.prompt.blocks import LayoutBuilder
from mmkv.runtime import DecodeOptions, LiveCache, LogitRules, TurnPolicy, TurnStores
from mmkv.runtime.decode import end_of_turn_id


def _sync(handle) -> None:
    if handle.device.type == "cuda":
        torch.cuda.synchronize(handle.device)


def _requests(handle, size: int, context: int, tokens: int, salt: int) -> list[Request]:
    """``size`` requests whose prompts are ~``context`` tokens of distinct text (the headroom arm's length)."""
    layouts = LayoutBuilder(handle)
    options = DecodeOptions(tokens, rules=LogitRules(logit_bias=((end_of_turn_id(handle), -100.0),)))
    probe = Conversation()
    probe.add_text(" ".join(f"w{salt}x0x{i}" for i in range(100)), "user")
    per_word = (
        layouts.build(probe, add_generation_prompt=True).num_tokens / 100
    )  # tokens a word takes (about)
    made = []
    for k in range(size):
        conversation = Conversation()
        words = " ".join(f"w{salt}x{k}x{i}" for i in range(int(context / per_word)))
        conversation.add_text(words, "user")
        layout = layouts.build(conversation, add_generation_prompt=True)
        made.append(
            Request(layout, (), TurnPolicy(reuse="none"), options, lambda e: None, live=LiveCache(handle))
        )
    return made


def engine_arm(handle, size: int, max_batch: int, context: int, tokens: int, salt: int) -> dict:
    """Tokens/s of the decode phase and the host work per decode step (step minus forward)."""
    turn_stores = lambda policy: TurnStores(handle, KVStore(), EncoderStore(), policy)  # noqa: E731
    core = EngineCore(handle, EngineConfig(max_batch, prefill_chunk=None, max_waiting=size), turn_stores)
    requests = _requests(handle, size, context, tokens, salt)
    for request in requests:
        core.add(request)
    forward_s = []
    step_forward = core.runner.batch.step

    def timed(*args):
        started = time.perf_counter()
        out = step_forward(*args)
        _sync(handle)
        forward_s.append(time.perf_counter() - started)
        return out

    core.runner.batch.step = timed
    host, decoding, padding = [], 0.0, []
    while core.has_work():
        all_running = all(r.status is Status.RUNNING for r in requests)
        before = len(forward_s)
        t0 = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - t0
        if (all_running or max_batch == 1) and len(forward_s) > before:
            decoding += elapsed
            host.append(elapsed - forward_s[-1])
            padding.append(core.runner.batch.padding)
    rows = size if max_batch > 1 else 1  # every counted forward ran all B rows (or the one row)
    return {"tokens_s": rows * len(host) / decoding,
            "host_ms": 1e3 * statistics.median(host), "padding": max(padding, default=0)}  # fmt: skip


def transformers_arm(handle, size: int, context: int, tokens: int) -> dict:
    """The headroom: B equal caches of ``context`` random entries, one forward per step for all."""
    layers, heads, dim = handle.kv_shape
    cache = DynamicCache(config=handle.text_config)
    for i in range(layers):
        shape = (size, heads, context, dim)  # (B, kv_heads, L, D)
        cache.update(torch.randn(shape, dtype=handle.dtype, device=handle.device),
                     torch.randn(shape, dtype=handle.dtype, device=handle.device), i)  # fmt: skip
    ids = torch.full((size, 1), 100, device=handle.device)  # (B, 1)
    started = time.perf_counter()
    with torch.inference_mode():
        for step in range(tokens):
            pos = torch.full((3, size, 1), context + step, device=handle.device)  # (3, B, 1)
            logits = handle.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1,
                                  **{cache_argument_name(handle.model): cache}).logits  # fmt: skip
            ids = logits[:, -1].argmax(-1, keepdim=True)
        _sync(handle)
    return {"tokens_s": size * tokens / (time.perf_counter() - started)}


def bench(handle, sizes, rounds: int, context: int, tokens: int) -> dict:
    arms = ["engine", "one at a time", "transformers"]
    samples = {(arm, b): [] for arm in arms for b in sizes}
    host = {b: [] for b in sizes}
    padding = {b: 0 for b in sizes}
    salt = 0
    for r in range(rounds):
        for b in sizes:
            for arm in arms[r % 3 :] + arms[: r % 3]:  # rotated: A B C, B C A, C A B
                salt += 1
                if arm == "transformers":
                    out = transformers_arm(handle, b, context, tokens)
                else:
                    out = engine_arm(handle, b, b if arm == "engine" else 1, context, tokens, salt)
                    if arm == "engine":
                        host[b].append(out["host_ms"])
                        padding[b] = max(padding[b], out["padding"])
                samples[(arm, b)].append(out["tokens_s"])
    table = {}
    for b in sizes:
        row = {arm: _summary(samples[(arm, b)]) for arm in arms}
        row["engine / headroom"] = row["engine"]["median"] / row["transformers"]["median"]
        row["engine / one at a time"] = row["engine"]["median"] / row["one at a time"]["median"]
        row["host_ms_per_step"] = _summary(host[b])
        row["padding_entries"] = padding[b]
        table[b] = row
    return table


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser, default="small-qwen3-vl")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=1000, help="prompt tokens per sequence (about)")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per sequence")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    handle = load_model(args, min_positions=args.context + 64)
    print(f"model {args.arch or args.model} on {handle.device} ({handle.dtype}); load {os.getloadavg()[0]:.1f}; "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    table = bench(handle, args.sizes, args.rounds, args.context, args.tokens)
    print(f"{'B':>3} {'engine tok/s':>22} {'one at a time':>22} {'transformers':>22} {'eng/head':>9} "
          f"{'eng/1':>6} {'host ms/step':>18} {'pad':>6}")  # fmt: skip
    fmt = lambda s: f"{s['median']:7.1f} ({s['min']:.1f}-{s['max']:.1f})"  # noqa: E731
    for b, row in table.items():
        h = row["host_ms_per_step"]
        print(f"{b:>3} {fmt(row['engine']):>22} {fmt(row['one at a time']):>22} {fmt(row['transformers']):>22} "
              f"{row['engine / headroom']:9.2f} {row['engine / one at a time']:6.2f} "
              f"{h['median']:6.2f} ({h['min']:.2f}-{h['max']:.2f}) {row['padding_entries']:>6}")  # fmt: skip
    print(f"load after: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "table": {str(k): v for k, v in table.items()}}, indent=1)
        )


if __name__ == "__main__":
    main()
