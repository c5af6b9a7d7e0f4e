"""Session time-to-first-token per reuse policy, measured side by side in one run.

Three parts:

1. **Trajectory**: a computer-use loop of ``--turns`` turns; each adds a new screenshot and a question, with a
   sliding window of ``--window`` screenshots. Per turn: TTFT of ``none``, ``encoder`` and ``kv``, and the store
   hit rate. When the oldest screenshot leaves, everything after it moves: ``kv`` splices it from the store,
   ``encoder`` re-prefills it from cached vision outputs, ``none`` recomputes it.
2. **Image sizes**: one screenshot already in the store, asked about after a *different* preamble, for each of
   ``--sizes`` (square, pixels). TTFT of ``none`` / ``encoder`` / ``kv`` and of a text-only turn with the same
   preamble and question (what ``kv`` must come close to), with speedups.
3. **Fidelity**: one screenshot cached after one preamble and reused after another: logit cosine against full
   recompute for ``encoder``, ``kv`` (seam 1 and 0), and the temporal-only and no-rotation controls.

Run::

    python bench/session.py                                   # tiny-qwen3-vl on the CPU
    python bench/session.py --model tiny-qwen2.5-vl --sizes 224 448
    python bench/session.py --arch qwen2.5-vl-7b --lm-layers 4 --vision-layers 4 --sizes 224 448 --turns 6
    python bench/session.py --arch qwen2.5-vl-7b --device cuda --dtype bfloat16 --sizes 224 448 896 1344 1792

``--arch`` builds a random-weight model of the released dimensions (``--lm-layers`` / ``--vision-layers`` cut
its depth for machines that cannot run all of it; per-layer costs are unchanged). Timings are medians of
``--repeats`` runs; ratios are what to read, absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from tqdm import tqdm

import mmkv
from mmkv.cache import EncoderStore, ImageKVStore
from mmkv.model.reference import REFERENCE_ARCHS, build_reference
from mmkv.synthetic import synthetic_screenshot

POLICIES = ("none", "encoder", "kv")


def _sync(handle: mmkv.ModelHandle) -> None:
    if handle.device.type == "cuda":
        torch.cuda.synchronize()


def _timed_logits(handle: mmkv.ModelHandle, session: mmkv.Session, question: str) -> float:
    """Time to first token of ``question``: rendering to logits on the host (store writes excluded, as in
    ``Answer.ttft_s``)."""
    _sync(handle)
    session.next_token_logits(question)
    return session.last_prefill.seconds


def warm_up(handle: mmkv.ModelHandle) -> None:
    """One untimed turn, so that one-off start-up costs (allocations, kernel selection) are not measured."""
    session = mmkv.Session(handle, reuse="none")
    session.add_image(synthetic_screenshot(99, (224, 168)))
    session.next_token_logits("Warm up.")


def trajectory(handle: mmkv.ModelHandle, turns: int, window: int, size: int) -> dict:
    """Per-turn TTFT of each policy over one computer-use trajectory; each policy has fresh stores."""
    shots = [synthetic_screenshot(seed, (size, size * 3 // 4)) for seed in range(turns)]
    result: dict = {"ttft": {p: [] for p in POLICIES}, "hit_rate": {}}
    for policy in POLICIES:
        session = mmkv.Session(
            handle, store=ImageKVStore(), encoder_store=EncoderStore(), reuse=policy, window=window
        )
        session.add_text("You operate a desktop app. Reply with one tool call.", role="system")
        for turn in tqdm(range(turns), desc=f"trajectory {policy}", leave=False):
            session.add_text(f"Step {turn}: here is the screen.")
            session.add_image(shots[turn])
            result["ttft"][policy].append(_timed_logits(handle, session, "What is the next action?"))
            session.add_text("What is the next action?")
            session.add_text(f"click(button_{turn})", role="assistant")
        images = [r for r in session.last_prefill.images]
        stats = session.store.stats().memory if policy == "kv" else session.encoder_store.stats().memory
        lookups = stats.hits + stats.misses
        result["hit_rate"][policy] = stats.hits / lookups if lookups else float("nan")
        result.setdefault("last_turn_sources", {})[policy] = [r.source for r in images]
    result["mean_ttft_turns_1plus"] = {
        p: statistics.mean(result["ttft"][p][1:]) for p in POLICIES if turns > 1
    }
    return result


def image_sizes(handle: mmkv.ModelHandle, sizes: list[int], repeats: int) -> list[dict]:
    """TTFT per policy for one cached screenshot after a different preamble, per image size."""
    rows = []
    for size in tqdm(sizes, desc="image sizes", leave=False):
        image = synthetic_screenshot(1000 + size, (size, size))
        store, encoder_store = ImageKVStore(), EncoderStore()
        warm = mmkv.Session(handle, store=store, encoder_store=encoder_store)
        warm.add_image(image)
        warm.next_token_logits("Describe the screen.")  # image KV and vision outputs now stored
        preamble = "Earlier you opened the settings page and changed the theme. Here is the screen again:"
        question = "Which button should be clicked next?"
        row = {"size": size, "image_tokens": 0, "ttft": {}}
        for policy in (*POLICIES, "text-only"):
            samples = []
            for _ in range(repeats):
                session = mmkv.Session(
                    handle,
                    store=store,
                    encoder_store=encoder_store,
                    reuse="none" if policy == "text-only" else policy,
                )
                session.add_text(preamble)
                if policy != "text-only":
                    session.add_image(image)
                samples.append(_timed_logits(handle, session, question))
                if policy == "kv":
                    row["kv_prefilled"] = session.last_prefill.prefilled
                if policy == "none":
                    row["image_tokens"] = session.last_prefill.prompt_tokens
                if policy == "text-only":
                    row["text_only_prefilled"] = session.last_prefill.prefilled
            row["ttft"][policy] = statistics.median(samples)
        row["image_tokens"] -= row["text_only_prefilled"]
        t = row["ttft"]
        row["speedup_kv"] = t["none"] / t["kv"]
        row["speedup_encoder"] = t["none"] / t["encoder"]
        row["kv_over_text_only"] = t["kv"] / t["text-only"]
        rows.append(row)
    return rows


FIDELITY_ARMS = {
    "encoder": mmkv.SessionConfig(reuse="encoder"),
    "kv": mmkv.SessionConfig(reuse="kv", seam=1),
    "kv, seam 0": mmkv.SessionConfig(reuse="kv", seam=0),
    "kv, temporal-only rotation": mmkv.SessionConfig(reuse="kv", seam=0, rotate_axes=(0,)),
    "kv, not rotated": mmkv.SessionConfig(reuse="kv", seam=0, rotate=False),
}


def fidelity(handle: mmkv.ModelHandle, size: int) -> dict[str, dict[str, float]]:
    """One screenshot cached after a short preamble, reused after a longer, different one: next-token logit
    cosine and max abs difference of each arm against full recompute (``none``)."""
    import torch.nn.functional as F

    image = synthetic_screenshot(7, (size, size * 3 // 4))
    store, encoder_store = ImageKVStore(), EncoderStore()
    warm = mmkv.Session(handle, store=store, encoder_store=encoder_store)
    warm.add_image(image)
    warm.next_token_logits("Describe the screen.")
    history = (
        "The user asked to open the settings page, then to switch to the dark theme. Here is the screen:"
    )

    def logits(config: mmkv.SessionConfig) -> torch.Tensor:
        session = mmkv.Session(handle, store=store, encoder_store=encoder_store, config=config)
        session.add_text(history)
        session.add_image(image)
        return session.next_token_logits("Which button should be clicked next?").float()

    reference = logits(mmkv.SessionConfig(reuse="none"))
    out = {}
    for arm, config in FIDELITY_ARMS.items():
        got = logits(config)
        out[arm] = {
            "cosine": F.cosine_similarity(got, reference, dim=0).item(),
            "max_abs": (got - reference).abs().max().item(),
            "same_argmax": bool(got.argmax() == reference.argmax()),
        }
    return out


def _print(handle, traj: dict | None, sizes: list[dict], fid: dict | None = None) -> None:
    print(
        f"model {handle.name}: {handle.family.name}, {handle.num_layers} LM layers, dtype {handle.dtype}, "
        f"device {handle.device}"
    )
    if traj:
        print("\ntrajectory: TTFT per turn (ms)")
        print("turn " + "".join(f"{p:>10s}" for p in POLICIES) + f"{'kv speedup':>12s}")
        for turn in range(len(traj["ttft"]["none"])):
            t = {p: 1e3 * traj["ttft"][p][turn] for p in POLICIES}
            print(f"{turn:4d} " + "".join(f"{t[p]:10.1f}" for p in POLICIES) + f"{t['none'] / t['kv']:12.2f}")
        later = slice(1, None)
        mean = {p: statistics.mean(traj["ttft"][p][later]) for p in POLICIES}
        print(
            f"mean of turns 1+: none {1e3 * mean['none']:.1f} ms, encoder {1e3 * mean['encoder']:.1f} ms "
            f"({mean['none'] / mean['encoder']:.2f}x), kv {1e3 * mean['kv']:.1f} ms "
            f"({mean['none'] / mean['kv']:.2f}x)"
        )
        print("store hit rate: " + ", ".join(f"{p} {r:.2f}" for p, r in traj["hit_rate"].items()))
    if fid:
        print("\nfidelity: image cached after one preamble, reused after another; logits vs full recompute")
        print(f"{'arm':28s} {'cosine':>9s} {'max abs':>9s} {'same top-1':>10s}")
        for arm, row in fid.items():
            print(f"{arm:28s} {row['cosine']:9.5f} {row['max_abs']:9.2e} {str(row['same_argmax']):>10s}")
    if sizes:
        print("\nimage sizes: one cached screenshot after a different preamble (ms)")
        print(
            f"{'px':>5s} {'img tok':>7s} {'none':>9s} {'encoder':>9s} {'kv':>9s} {'text-only':>9s} "
            f"{'kv x':>6s} {'enc x':>6s} {'kv/text':>7s}"
        )
        for r in sizes:
            t = {k: 1e3 * v for k, v in r["ttft"].items()}
            print(
                f"{r['size']:5d} {r['image_tokens']:7d} {t['none']:9.1f} {t['encoder']:9.1f} {t['kv']:9.1f} "
                f"{t['text-only']:9.1f} {r['speedup_kv']:6.2f} {r['speedup_encoder']:6.2f} "
                f"{r['kv_over_text_only']:7.2f}"
            )


def _handle(args) -> mmkv.ModelHandle:
    dtype = getattr(torch, args.dtype)
    if args.arch:
        return build_reference(args.arch, args.lm_layers, args.vision_layers, args.device or "cpu", dtype)
    return mmkv.load(args.model, device=args.device, dtype=dtype)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-qwen3-vl", help="a name mmkv.load understands")
    parser.add_argument("--arch", choices=REFERENCE_ARCHS, help="random weights of a released model's size")
    parser.add_argument("--lm-layers", type=int, default=None)
    parser.add_argument("--vision-layers", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--shot-size", type=int, default=448, help="trajectory screenshot width in pixels")
    parser.add_argument("--sizes", type=int, nargs="*", default=[224, 448, 896])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-pixels", type=int, default=None, help="override the processor's pixel bound")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    handle = _handle(args)
    if args.max_pixels:
        handle.processor.image_processor.size = {
            **dict(handle.processor.image_processor.size),
            "longest_edge": args.max_pixels,
        }
    warm_up(handle)
    traj = trajectory(handle, args.turns, args.window, args.shot_size) if args.turns else None
    sizes = image_sizes(handle, args.sizes, args.repeats) if args.sizes else []
    fid = fidelity(handle, args.shot_size)
    _print(handle, traj, sizes, fid)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": handle.name, "trajectory": traj, "sizes": sizes, "fidelity": fid}, f, indent=1
            )
