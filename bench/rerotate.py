"""Re-rotation cost at real model dimensions (random keys): mmkv's one batched call against the per-layer loop
over transformers' own rotary embedding, side by side in one run.

Run::

    python bench/rerotate.py                     # CPU, float32, both architectures, 256 and 1024 image tokens
    python bench/rerotate.py --device cuda --dtype bfloat16 --tokens 256 1024 2304 4096 --json rerotate.json

Prints per configuration: KV size, each method's median ms with min-max (the two methods interleaved, round
by round), their ratio, their max abs difference, and the bytes-moved floor: the keys read once and written
once at ``--bandwidth`` GB/s (default the H200's 4800; values are never touched by a re-rotation).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable (for bench.timing)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from bench.timing import interleave
from mmkv.model.reference import reference_config
from mmkv.mrope import rerotate, rotary_layout_from_config

ARCHS = [
    ("qwen2.5-vl-7b", "sectioned", Qwen2_5_VLRotaryEmbedding),
    ("qwen3-vl-8b", "interleaved", Qwen3VLTextRotaryEmbedding),
]


def bench(
    tokens: list[int], device: str, dtype: torch.dtype, repeats: int, bandwidth_gbs: float = 4800.0
) -> list[dict]:
    """Time both methods (interleaved) for each architecture and token count; one row per configuration."""
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

            timing = interleave({"fused": fused, "hf_loop": per_layer_hf}, repeats, device)
            fused_ms, loop_ms = timing["fused"].median, timing["hf_loop"].median
            key_bytes = keys.numel() * keys.element_size()
            diff = (fused().float() - per_layer_hf().float()).abs().max().item()
            rows.append(
                {
                    "arch": arch,
                    "tokens": n,
                    "kv_mb": 2 * keys.numel() * keys.element_size() / 2**20,
                    "fused_ms": fused_ms,
                    "fused": timing["fused"].as_dict(),
                    "hf_loop_ms": loop_ms,
                    "hf_loop": timing["hf_loop"].as_dict(),
                    "floor_ms": 2 * key_bytes / (bandwidth_gbs * 1e9) * 1e3,  # K read + K written
                    "ratio": loop_ms / fused_ms,
                    "max_abs": diff,
                }
            )
    return rows


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/rerotate.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s for the bytes-moved floor")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    results = bench(args.tokens, args.device, getattr(torch, args.dtype), args.repeats, args.bandwidth)
    print(
        f"{'arch':14s} {'tokens':>6s} {'KV MB':>7s} {'mmkv ms [min-max]':>22s} {'HF loop ms [min-max]':>24s} "
        f"{'ratio':>6s} {'floor ms':>8s} {'max abs':>8s}"
    )
    for r in results:
        f, h = r["fused"], r["hf_loop"]
        print(
            f"{r['arch']:14s} {r['tokens']:6d} {r['kv_mb']:7.1f} "
            f"{f['median']:9.2f} [{f['min']:.2f}-{f['max']:.2f}]".ljust(54)
            + f"{h['median']:10.2f} [{h['min']:.2f}-{h['max']:.2f}]".rjust(24)
            + f" {r['ratio']:6.2f} {r['floor_ms']:8.3f} {r['max_abs']:8.1e}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "rows": results}))
