"""A turn's host-side cost against how long the conversation already is (no window): what a turn costs beyond
the model's own forward, at turns 1, 10, 50, 100, 200.

Each turn adds a line of text and a screenshot and asks a question. At each checkpoint turn, once the new
screenshot is in (one untimed ask), a question is asked ``--repeats`` more times (a different one each time,
so the user's last message is new and only it is prefilled) and timed from the call to the first
token's logits (``last_prefill.seconds``). The forward's share is what the turn itself reports
(``last_prefill.forward_seconds``) where the tree reports it; otherwise (older trees) the same forward is
timed alone right after (the same new tokens over a copy of the same cache, through ``prefill_span``), which
is noisier. ``host = total - forward`` is everything but the model's forward. Runs against any mmkv tree
(public API only), so ``bench/ab.py`` can compare two in one run::

    python bench/turn_cost.py --model small-qwen3-vl --turns 200 --json /tmp/cost.json
    python bench/ab.py --trees /tmp/before . --rounds 3 --keys host_ms -- \\
        bench/turn_cost.py --turns 200 --json {json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import mmkv
from mmkv.kv import prefill_span, segments_to_cache
from mmkv.synthetic import synthetic_screenshot

CHECKPOINTS = (1, 10, 50, 100, 200)


def _live_segment(session: mmkv.Session) -> mmkv.KVSegment:
    live = getattr(session, "live", None)
    return live.segment() if live is not None and hasattr(live, "segment") else session.live_segment()


def _forward_alone(handle, session: mmkv.Session, question: str, prefilled: int) -> float:
    """Seconds of the same forward alone: the turn's last ``prefilled`` prompt tokens over a copy of the cache
    holding the rest."""
    ids, _ = session.render(question)
    whole = _live_segment(session)
    n = int(ids.shape[0])
    cache = segments_to_cache([whole.slice(0, n - prefilled)], handle.text_config) if n > prefilled else None
    positions = whole.position_ids[:, n - prefilled : n]
    started = time.perf_counter()
    prefill_span(handle, ids[n - prefilled :], positions, context=cache)
    return time.perf_counter() - started


def run(model: str, turns: int, repeats: int, size: int) -> dict:
    # 200 turns need more positions than the small models were trained for: fine for timing, not for answers
    handle = mmkv.load(model, device="cpu").with_position_limit(1 << 16)
    session = mmkv.Session(handle)
    session.add_text("You operate a desktop app. Reply with one tool call.", role="system")
    out = {"model": model, "turns": [], "total_ms": [], "forward_ms": [], "host_ms": [], "prompt_tokens": []}
    with torch.inference_mode():
        for turn in range(1, turns + 1):
            session.add_text(f"Step {turn}: here is the screen.")
            session.add_image(synthetic_screenshot(turn, (size, size * 3 // 4)))
            if turn in CHECKPOINTS or turn == turns:
                session.next_token_logits("What is the next action?")  # the new screenshot, untimed
                totals, forwards = [], []
                for r in range(repeats):
                    question = f"What is the next action, attempt {r}?"
                    session.next_token_logits(question)
                    stats = session.last_prefill
                    totals.append(stats.seconds)
                    reported = getattr(stats, "forward_seconds", None)
                    forwards.append(reported or _forward_alone(handle, session, question, stats.prefilled))
                total = statistics.median(totals)
                forward = statistics.median(forwards)
                out.setdefault("host_per_call_ms", []).append(
                    1e3 * statistics.median(t - f for t, f in zip(totals, forwards, strict=True))
                )
                out["turns"].append(turn)
                out["total_ms"].append(1e3 * total)
                out["forward_ms"].append(1e3 * forward)
                out["host_ms"].append(1e3 * (total - forward))
                out["prompt_tokens"].append(session.last_prefill.prompt_tokens)
            else:
                session.next_token_logits("What is the next action?")
            session.add_text("What is the next action?")
            session.add_text(f"click(button_{turn})", role="assistant")
    return out


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/turn_cost.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl", help="a name mmkv.load understands")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="timed asks per checkpoint turn (median)")
    parser.add_argument("--size", type=int, default=448, help="screenshot width in pixels")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.model, args.turns, args.repeats, args.size)
    print(f"{'turn':>5s} {'prompt':>7s} {'total ms':>9s} {'forward ms':>11s} {'host ms':>8s}")
    for i, turn in enumerate(result["turns"]):
        print(
            f"{turn:5d} {result['prompt_tokens'][i]:7d} {result['total_ms'][i]:9.2f} {result['forward_ms'][i]:11.2f} "
            f"{result['host_ms'][i]:8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result))
