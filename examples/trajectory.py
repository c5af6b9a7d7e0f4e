"""An agent trajectory over screenshots, run twice in lockstep: reusing cached images (``kv``) and not (``none``).

Each turn the agent sees a new screenshot (the last ``--window`` stay in the prompt; screenshots also come back
later, as they do when an agent revisits a page) and answers a question. Per turn it prints where each image's
KV came from, the time to first token of both sessions, and whether their first answer tokens agree.

Run::

    python examples/trajectory.py                            # tiny-qwen3-vl, random weights, CPU
    python examples/trajectory.py --model tiny-qwen2.5-vl --turns 8 --window 3
    python examples/trajectory.py --store /tmp/mmkv-store    # persistent store: a second run hits on disk
    python examples/trajectory.py --model qwen3-vl-8b        # with the weights available locally
"""

from __future__ import annotations

import argparse

import torch

import mmkv
from mmkv.cache import EncoderStore, ImageKVStore
from mmkv.synthetic import synthetic_screenshot

PAGES = 4  # distinct screens the agent moves between


def run(
    model: str = "tiny-qwen3-vl",
    turns: int = 6,
    window: int | None = 3,
    store_dir: str | None = None,
    device: str | None = None,
) -> list[dict]:
    """Run the trajectory; returns one row per turn (TTFTs, agreement, image sources)."""
    handle = mmkv.load(model, device=device)
    store = ImageKVStore(path=store_dir)
    encoder_store = EncoderStore(path=None if store_dir is None else f"{store_dir}/encoder")
    sessions = {
        "kv": mmkv.Session(handle, store=store, encoder_store=encoder_store, reuse="kv", window=window),
        "none": mmkv.Session(handle, reuse="none", window=window),
    }
    for session in sessions.values():
        session.add_text("You operate a desktop app. Answer with one tool call.", role="system")
    print(f"model {handle.name} ({handle.family.name}, {handle.layout.kind} M-RoPE), window {window}")
    print(
        f"{'turn':>4s} {'images (source)':42s} {'kv ms':>8s} {'none ms':>8s} {'speedup':>8s} {'same 1st tok':>12s}"
    )
    rows = []
    for turn in range(turns):
        shot = synthetic_screenshot(turn % PAGES, (448, 336))
        answers = {}
        for name, session in sessions.items():
            session.add_text(f"Step {turn}:")
            session.add_image(shot)
            answers[name] = session.ask("What is the next action?", max_new_tokens=8)
        kv, none = answers["kv"], answers["none"]
        sources = " ".join(f"{r.index}:{r.source}" for r in kv.images)
        same = kv.token_ids[:1] == none.token_ids[:1]
        print(
            f"{turn:4d} {sources:42s} {1e3 * kv.ttft_s:8.1f} {1e3 * none.ttft_s:8.1f} "
            f"{none.ttft_s / kv.ttft_s:8.2f} {str(same):>12s}"
        )
        rows.append(
            {
                "turn": turn,
                "kv_ttft": kv.ttft_s,
                "none_ttft": none.ttft_s,
                "same_first_token": same,
                "sources": [r.source for r in kv.images],
            }
        )
    stats = store.stats()
    print(
        f"KV store: memory hits {stats.memory.hits}, misses {stats.memory.misses}, "
        f"{stats.memory.bytes / 2**20:.1f} MiB" + (f"; disk hits {stats.disk.hits}" if stats.disk else "")
    )
    agree = sum(r["same_first_token"] for r in rows) / len(rows)
    print(
        f"first-token agreement kv vs none: {agree:.2f} (random-weight tiny models: a smoke check, not an eval)"
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-qwen3-vl", help="alias, hub id or checkpoint directory")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--window", type=int, default=3, help="screenshots kept in the prompt (0: all)")
    parser.add_argument(
        "--store", default=None, help="directory of a persistent store (default: memory only)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    run(args.model, args.turns, args.window or None, args.store, args.device)
