"""Loading an image's KV from each store tier against recomputing it, at Qwen2.5-VL-7B's real record size.

A record of random keys and values at Qwen2.5-VL-7B's dimensions (28 layers, 4 KV heads, head_dim 128,
bfloat16: 56 KiB per token) for 256 and 1024 image tokens (448 and 896 px), loaded from the memory tier, a
local disk tier and a Redis on 127.0.0.1 (a redis-server this script starts), the tiers interleaved round by
round; against the time to recompute the same image on this machine: the vision tower and the image's prefill
at the released width with the depth cut (``--lm-layers``/``--vision-layers``), scaled to the full depth
(per-layer costs are the real ones). Prints latency (median [min-max]) and throughput (GB/s) per tier.

    python bench/store.py --json runs/store.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import mmkv
from bench.timing import interleave
from mmkv.cache import KVStore
from mmkv.kv import encode_images, image_span, prefill_span
from mmkv.model.reference import build_reference, reference_config
from mmkv.synthetic import synthetic_screenshot

ARCH = "qwen2.5-vl-7b"


def _record(handle, tokens: int) -> mmkv.KVSegment:
    cfg = reference_config(ARCH).text_config
    shape = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, tokens, 128)  # (layers, 1, kv_heads, L, D)
    ids = torch.full((tokens,), handle.processor.image_token_id, dtype=torch.long)
    positions = torch.arange(tokens).expand(3, -1).clone()
    return mmkv.KVSegment(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16(), ids, positions, "image",
                          f"{tokens:064x}", handle.rotary)  # fmt: skip


def _recompute_ms(handle, size: int, lm_layers: int, vision_layers: int, repeats: int) -> dict:
    """The vision tower and the image prefill, timed at the cut depth, scaled to the full depth."""
    full = reference_config(ARCH)
    image = synthetic_screenshot(size, (size, size))
    inputs = handle.processor.preprocess_images([image])
    ids, positions = image_span(handle, inputs.image_grid_thw[0], 20)
    features = encode_images(handle, inputs)
    timings = interleave(
        {"vision": lambda: encode_images(handle, inputs),
         "prefill": lambda: prefill_span(handle, ids, positions, features=features, keep_segment=False)},
        repeats,
    )  # fmt: skip
    vision = timings["vision"].median * full.vision_config.depth / vision_layers
    prefill = timings["prefill"].median * full.text_config.num_hidden_layers / lm_layers
    return {
        "vision_ms": vision,
        "prefill_ms": prefill,
        "total_ms": vision + prefill,
        "tokens": int(ids.shape[0]),
    }


def run(args) -> list[dict]:
    from tests.redis_server import RedisServer

    handle = build_reference(ARCH, args.lm_layers, args.vision_layers, "cpu", torch.float32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis_server:
        for tokens, size in ((256, 448), (1024, 896)):
            record = _record(handle, tokens)
            nbytes = record.nbytes
            stores = {"memory": KVStore(), "disk": KVStore(path=Path(tmp) / f"d{tokens}"),
                      "redis": KVStore(path=redis_server.url, redis_timeout_s=5.0)}  # fmt: skip
            for store in stores.values():
                store.put(record.digest, record, handle)

            def load(name: str, stores=stores, record=record):
                store = stores[name]
                if name != "memory":
                    store._memory.clear()  # read the tier itself, not its promotion to memory
                value, tier = store.lookup(record.digest, handle)
                assert tier == name and value is not None

            timings = interleave({name: (lambda n=name: load(n)) for name in stores}, args.repeats)
            recompute = _recompute_ms(
                handle, size, args.lm_layers, args.vision_layers, max(2, args.repeats // 3)
            )
            row = {"tokens": tokens, "record_mb": nbytes / 1e6, "recompute": recompute}
            for name, timing in timings.items():
                row[name] = timing.as_dict() | {"gb_per_s": nbytes / (timing.median / 1e3) / 1e9}
            rows.append(row)
            print(json.dumps(row))
    return rows


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/store.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lm-layers", type=int, default=2)
    parser.add_argument("--vision-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.time()
    result = run(args)
    print(
        f"{'tokens':>6s} {'MB':>6s} {'memory ms':>10s} {'disk ms (GB/s)':>16s} {'redis ms (GB/s)':>16s} {'recompute ms':>13s}"
    )
    for r in result:
        print(f"{r['tokens']:6d} {r['record_mb']:6.1f} {r['memory']['median']:10.3f} "
              f"{r['disk']['median']:9.1f} ({r['disk']['gb_per_s']:.2f}) {r['redis']['median']:9.1f} "
              f"({r['redis']['gb_per_s']:.2f}) {r['recompute']['total_ms']:13.0f}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
