"""Re-rotation cost at real model dimensions (random keys): mmkv's one batched call against the per-layer loop
over transformers' own rotary embedding, side by side in one run.

Run::

    python bench/rerotate.py                     # CPU, float32, both architectures, 256 and 1024 image tokens
    python bench/rerotate.py --device cuda --dtype bfloat16 --tokens 256 1024 3136 4096

Prints per configuration: KV size, median ms of each method, the ratio, and their max abs difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from mmkv.model.reference import reference_config
from mmkv.mrope import rerotate, rotary_layout_from_config

ARCHS = [
    ("qwen2.5-vl-7b", "sectioned", Qwen2_5_VLRotaryEmbedding),
    ("qwen3-vl-8b", "interleaved", Qwen3VLTextRotaryEmbedding),
]


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(1e3 * (time.perf_counter() - started))
    return statistics.median(samples)


def bench(tokens: list[int], device: str, dtype: torch.dtype, repeats: int) -> list[dict]:
    """Time both methods for each architecture and token count; returns one row per configuration."""
    device = torch.device(device)
    rows = []
    for arch, kind, rotary_class in ARCHS:
        config = reference_config(arch).text_config
        layers, heads = config.num_hidden_layers, config.num_key_value_heads
        layout = rotary_layout_from_config(config, kind)
        rotary = rotary_class(config).to(device)
        for n in tokens:
            keys = torch.randn(layers, 1, heads, n, 128, device=device).to(dtype)  # (layers, 1, H, L, D)
            positions = torch.arange(n, device=device).expand(3, -1)  # (3, L)
            delta = 161

            def fused(keys=keys, layout=layout, positions=positions, delta=delta):
                return rerotate(keys, delta, layout, from_positions=positions)

            def per_layer_hf(keys=keys, rotary=rotary, n=n, delta=delta):
                cos, sin = rotary(keys, torch.full((3, 1, n), delta, device=device))  # (1, L, D)
                return torch.stack([apply_rotary_pos_emb(k, k, cos, sin)[1] for k in keys])

            fused_ms = _time(fused, repeats, device)
            loop_ms = _time(per_layer_hf, repeats, device)
            diff = (fused().float() - per_layer_hf().float()).abs().max().item()
            rows.append(
                {
                    "arch": arch,
                    "tokens": n,
                    "kv_mb": 2 * keys.numel() * keys.element_size() / 2**20,
                    "fused_ms": fused_ms,
                    "hf_loop_ms": loop_ms,
                    "ratio": loop_ms / fused_ms,
                    "max_abs": diff,
                }
            )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = bench(args.tokens, args.device, getattr(torch, args.dtype), args.repeats)
    print(
        f"{'arch':14s} {'tokens':>6s} {'KV MB':>7s} {'mmkv ms':>8s} {'HF loop ms':>10s} {'ratio':>6s} {'max abs':>8s}"
    )
    for r in results:
        print(
            f"{r['arch']:14s} {r['tokens']:6d} {r['kv_mb']:7.1f} {r['fused_ms']:8.1f} {r['hf_loop_ms']:10.1f} "
            f"{r['ratio']:6.2f} {r['max_abs']:8.1e}"
        )
