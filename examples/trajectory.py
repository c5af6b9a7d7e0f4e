"""An agent trajectory over screenshots, run twice in lockstep: reusing cached images (``kv``) and not (``none``).

On the shipped ``small-qwen3-vl`` the agent is the task suite's ticket desk: the policy as system prompt, one UI
panel per turn (panels come back later, as pages do when an agent revisits them), the next tool call as the
answer; the model was trained on single turns, so each prompt holds the system prompt and the latest turn
(``history_start``), while the stores keep every panel. Other models get synthetic screenshots and the last
``--window`` of them. Per turn it prints where the prompt's images came from, both sessions' time to first
token (one untimed warm-up turn first), their answers and whether they agree.

Run::

    python examples/trajectory.py                            # small-qwen3-vl (shipped), CPU
    python examples/trajectory.py --model tiny-qwen2.5-vl --turns 8 --window 3
    python examples/trajectory.py --store /tmp/mmkv-store    # persistent store: a second run hits on disk
    python examples/trajectory.py --model qwen3-vl-8b        # with the weights available locally
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.cli import HelpFormatter
from mmkv.synthetic import synthetic_screenshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's app/ package
from app.format import images_summary  # noqa: E402
from app.trajectory import POLICY, TRAJECTORY  # noqa: E402

PAGES = 4  # distinct screens the agent moves between


def run(
    model: str = "small-qwen3-vl",
    turns: int = 6,
    window: int | None = 3,
    store_dir: str | None = None,
    device: str | None = None,
) -> list[dict]:
    """Run the trajectory; returns one row per turn (TTFTs, agreement, image sources)."""
    handle = mmkv.load(model, device=device)
    store = KVStore(path=store_dir)
    encoder_store = EncoderStore(path=None if store_dir is None else f"{store_dir}/encoder")
    sessions = {
        "kv": mmkv.Session(handle, store=store, encoder_store=encoder_store, reuse="kv", window=window),
        "none": mmkv.Session(handle, reuse="none", window=window),
    }
    shipped = model.startswith("small-")
    system = POLICY if shipped else "You operate a desktop app. Answer with one tool call."
    for session in sessions.values():
        session.add_text(system, role="system")
    warm = mmkv.Session(handle, reuse="none")  # one-off start-up costs, outside the timed turns
    warm.add_image(synthetic_screenshot(99, (448, 336)))
    warm.next_token_logits("Warm up.")
    print(f"model {handle.name} ({handle.family.name}, {handle.rotary.kind} M-RoPE), window {window}")
    print(
        f"{'turn':>4s} {'images':42s} {'kv ms':>8s} {'none ms':>8s} {'speedup':>8s} {'kv answer':>16s} {'same':>6s}"
    )
    rows = []
    for turn in range(turns):
        step = TRAJECTORY[turn % len(TRAJECTORY)]
        shot = step.path if shipped else synthetic_screenshot(turn % PAGES, (448, 336))
        answers = {}
        for name, session in sessions.items():
            if shipped:
                session.history_start = len(session.conversation.messages)  # single-turn prompts
            else:
                session.add_text(f"Step {turn}:")
            session.add_image(shot)
            answers[name] = session.ask(
                step.text if shipped else "What is the next action?", max_new_tokens=8
            )
        kv, none = answers["kv"], answers["none"]
        sources = images_summary(kv.images)
        same = kv.token_ids == none.token_ids
        print(
            f"{turn:4d} {sources:42s} {1e3 * kv.ttft_s:8.1f} {1e3 * none.ttft_s:8.1f} "
            f"{none.ttft_s / kv.ttft_s:8.2f} {kv.text[:16]:>16s} {str(same):>6s}"
        )
        rows.append(
            {
                "turn": turn,
                "kv_ttft": kv.ttft_s,
                "none_ttft": none.ttft_s,
                "same_answer": same,
                "answer": kv.text,
                "sources": [r.source for r in kv.images],
            }
        )
    stats = store.stats()
    print(
        f"KV store: memory hits {stats.memory.hits}, misses {stats.memory.misses}, "
        f"{stats.memory.bytes / 2**20:.1f} MiB" + (f"; disk hits {stats.disk.hits}" if stats.disk else "")
    )
    agree = sum(r["same_answer"] for r in rows) / len(rows)
    note = "" if shipped else " (random-weight models: a smoke check, not an eval)"
    print(f"answer agreement kv vs none: {agree:.2f}{note}")
    return rows


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("examples/trajectory.py")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl", help="alias, hub id or checkpoint directory")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--window", type=int, default=3, help="screenshots kept in the prompt (0: all)")
    parser.add_argument(
        "--store", default=None, help="directory of a persistent store (default: memory only)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    run(args.model, args.turns, args.window or None, args.store, args.device)
