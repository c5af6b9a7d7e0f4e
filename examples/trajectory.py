"""A small agent trajectory that re-reads one screenshot: cache its KV once, splice it later, compare.

Turn 1 prefills ``[preamble, screenshot, question]``. In turn 2 the same screenshot comes back after a longer
history. We splice its cached KV there three ways and compare each with full recompute of turn 2:

- ``moved, same context``: the screenshot cached after the same preamble, re-rotated to the new start
  (exact: K/V max abs ~1e-6);
- ``spliced, re-rotated``: the turn-1 KV re-rotated into the turn-2 context (position-independent reuse,
  an approximation: the image KV attended to a different prefix);
- ``spliced, not rotated``: the same KV left at its old positions (the control).

Run::

    python examples/trajectory.py                        # tiny-qwen3-vl, random weights, CPU
    python examples/trajectory.py --model tiny-qwen2.5-vl
    python examples/trajectory.py --model qwen3-vl-8b    # with the weights available locally
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import mmkv
from mmkv.kv import image_span, prefill_span, segments_to_cache, text_span


def screenshot(seed: int = 0, size: tuple[int, int] = (224, 160)) -> Image.Image:
    """A synthetic 'screenshot': a few coloured boxes on a light background."""
    rng = np.random.default_rng(seed)
    pixels = np.full((size[1], size[0], 3), 235, dtype=np.uint8)
    for _ in range(6):
        x, y = rng.integers(0, size[0] - 40), rng.integers(0, size[1] - 30)
        pixels[y : y + 30, x : x + 40] = rng.integers(0, 255, 3)
    return Image.fromarray(pixels, "RGB")


def encode(handle: mmkv.ModelHandle, text: str) -> torch.Tensor:
    return torch.tensor(handle.processor.encode_text(text), dtype=torch.long)


def run(model: str = "tiny-qwen3-vl", device: str | None = None) -> dict[str, dict[str, float]]:
    """Run the trajectory; returns, per way of reuse, the max abs logit error, logit cosine and time."""
    handle = mmkv.load(model, device=device)
    images = handle.processor.preprocess_images([screenshot()])
    grid = images.image_grid_thw[0]
    preamble = encode(handle, "<|im_start|>user\n")
    history = encode(
        handle,
        "<|im_start|>user\nOpen the settings page.<|im_end|>\n<|im_start|>assistant\n"
        "click(settings)<|im_end|>\n<|im_start|>user\nHere is the screen again:\n",
    )
    question = encode(handle, "Which button is highlighted?<|im_end|>\n<|im_start|>assistant\n")

    # Turn 1: the screenshot right after the preamble; its segment goes to the cache.
    turn1 = prefill_span(handle, *text_span(preamble, 0))
    ids, pos = image_span(handle, grid, turn1.segment.end)
    cached = prefill_span(handle, ids, pos, context=turn1.cache, images=images).segment

    # Turn 2, full recompute: history, screenshot, question, all prefilled (the reference).
    def full_turn2() -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        hist = prefill_span(handle, *text_span(history, 0))
        ids, pos = image_span(handle, grid, hist.segment.end)
        img = prefill_span(handle, ids, pos, context=hist.cache, images=images)
        out = prefill_span(handle, *text_span(question, img.segment.end), context=img.cache)
        return out.logits, time.perf_counter() - started

    reference, full_seconds = full_turn2()
    hist = prefill_span(handle, *text_span(history, 0))
    image_start = hist.segment.end

    def splice(segment: mmkv.KVSegment) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        cache = segments_to_cache([hist.segment, segment], handle.text_config)
        end = image_start + segment.num_slots
        out = prefill_span(handle, *text_span(question, end), context=cache)
        return out.logits, time.perf_counter() - started

    # The same screenshot cached after the same preamble at another offset: exact when moved.
    offset = image_start - len(preamble)
    same_ctx = prefill_span(handle, *text_span(preamble, offset))
    ids, pos = image_span(handle, grid, image_start)
    direct = prefill_span(handle, ids, pos, context=same_ctx.cache, images=images).segment
    moved = cached.moved_to(image_start)
    rows: dict[str, dict[str, float]] = {
        "moved, same context (K max abs)": {
            "max_abs": (moved.keys - direct.keys).abs().max().item(),
            "cosine": float("nan"),
            "seconds": float("nan"),
        }
    }
    for label, segment in (("spliced, re-rotated", moved), ("spliced, not rotated", cached)):
        logits, seconds = splice(segment)
        rows[label] = {
            "max_abs": (logits - reference).abs().max().item(),
            "cosine": F.cosine_similarity(logits, reference, dim=0).item(),
            "seconds": seconds,
        }
    rows["full recompute"] = {"max_abs": 0.0, "cosine": 1.0, "seconds": full_seconds}
    print(
        f"model {handle.name} ({handle.family.name}, {handle.layout.kind} M-RoPE), image grid {grid.tolist()}, "
        f"{cached.length} image tokens, moved by {image_start - cached.start} positions"
    )
    print(f"{'reuse':34s} {'max abs':>10s} {'cosine':>8s} {'ms':>8s}")
    for label, row in rows.items():
        print(f"{label:34s} {row['max_abs']:10.2e} {row['cosine']:8.4f} {1e3 * row['seconds']:8.1f}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-qwen3-vl", help="alias, hub id or checkpoint directory")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    args = parser.parse_args()
    run(args.model, args.device)
