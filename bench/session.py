"""Session time-to-first-token per reuse policy, every comparison interleaved in one process.

Parts (each prints medians with min-max; arms always run A B C A B C ..., the order rotated each round):

1. **Trajectory**: a computer-use loop of ``--turns`` turns, a new screenshot and a question each turn, a
   sliding window of ``--window``; the ``none`` / ``encoder`` / ``kv`` sessions advance in lockstep (each turn
   all three, in rotating order), each with fresh stores.
2. **Image sizes**: one screenshot already in the store, asked about after a *different* preamble, for each of
   ``--sizes``: ``none`` / ``encoder`` / ``kv`` and a text-only turn (same preamble and question, no image: what
   ``kv`` must come close to), ``--repeats`` rounds.
3. **Against text only** (``--ratios``): (a) the image-sizes ``kv``/text-only ratio at the model's own image
   size; (b) a window slide with every screenshot already stored: the ``kv`` turn against the same turn of a
   conversation without screenshots; (c) ``--many`` stored screenshots spliced into one turn against a
   text-only turn.
4. **Fidelity**: one screenshot cached after one preamble and reused after another: logit cosine against full
   recompute for ``encoder``, ``kv`` (seam 1 and 0), and the temporal-only and no-rotation controls.

Run::

    python bench/session.py                                   # tiny-qwen3-vl on the CPU
    python bench/session.py --model small-qwen3-vl --ratios --sizes 448 --turns 0
    python bench/session.py --arch qwen2.5-vl-7b --lm-layers 4 --vision-layers 4 --sizes 224 448 --turns 6
    python bench/session.py --arch qwen2.5-vl-7b --device cuda --dtype bfloat16 --sizes 224 448 896 1344 1792

``--arch`` builds a random-weight model of the released dimensions (``--lm-layers`` / ``--vision-layers`` cut
its depth for machines that cannot run all of it; per-layer costs are unchanged). Ratios are what to read;
absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable (for bench.timing)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm import tqdm

import mmkv
from bench.models import add_model_arguments, load_model
from bench.timing import Timing, interleave
from mmkv.cache import EncoderStore, KVStore
from mmkv.synthetic import synthetic_screenshot

POLICIES = ("none", "encoder", "kv")
SYSTEM = "You operate a desktop app. Reply with one tool call."
PREAMBLE = "Earlier you opened the settings page and changed the theme. Here is the screen again:"
QUESTION = "Which button should be clicked next?"


def _sync(handle: mmkv.ModelHandle) -> None:
    if handle.device.type == "cuda":
        torch.cuda.synchronize()


def _ttft_ms(handle: mmkv.ModelHandle, session: mmkv.Session, question: str) -> float:
    """Time to first token of ``question`` in ms: rendering to logits on the host (store writes excluded, as in
    ``Answer.ttft_s``)."""
    _sync(handle)
    session.next_token_logits(question)
    return 1e3 * session.last_prefill.seconds


def warm_up(handle: mmkv.ModelHandle) -> None:
    """One untimed turn, so that one-off start-up costs (allocations, kernel selection) are not measured."""
    session = mmkv.Session(handle, reuse="none")
    session.add_image(synthetic_screenshot(99, (224, 168)))
    session.next_token_logits("Warm up.")


def _shots(count: int, size: int, seed: int = 0) -> list:
    return [synthetic_screenshot(seed + i, (size, size * 3 // 4)) for i in range(count)]


def trajectory(handle: mmkv.ModelHandle, turns: int, window: int, size: int) -> dict:
    """Per-turn TTFT (ms) of each policy over one trajectory, the policies advancing in lockstep."""
    shots = _shots(turns, size)
    sessions = {
        p: mmkv.Session(handle, store=KVStore(), encoder_store=EncoderStore(), reuse=p, window=window)
        for p in POLICIES
    }
    result: dict = {"ttft": {p: [] for p in POLICIES}, "hit_rate": {}}
    for session in sessions.values():
        session.add_text(SYSTEM, role="system")
    for turn in tqdm(range(turns), desc="trajectory", leave=False):
        order = POLICIES[turn % 3 :] + POLICIES[: turn % 3]
        for policy in order:
            session = sessions[policy]
            session.add_text(f"Step {turn}: here is the screen.")
            session.add_image(shots[turn])
            result["ttft"][policy].append(_ttft_ms(handle, session, "What is the next action?"))
            session.add_text("What is the next action?")
            session.add_text(f"click(button_{turn})", role="assistant")
    for policy, session in sessions.items():
        stats = session.store.stats().memory if policy == "kv" else session.encoder_store.stats().memory
        lookups = stats.hits + stats.misses
        result["hit_rate"][policy] = stats.hits / lookups if lookups else float("nan")
    result["last_turn_sources"] = {p: [r.source for r in s.last_prefill.images] for p, s in sessions.items()}
    result["mean_ttft_turns_1plus"] = {
        p: statistics.mean(result["ttft"][p][1:]) for p in POLICIES if turns > 1
    }
    return result


def _stored(handle: mmkv.ModelHandle, images: list) -> tuple[KVStore, EncoderStore]:
    """Stores holding ``images``' KV and vision outputs, computed after an unrelated context."""
    store, encoder_store = KVStore(), EncoderStore()
    warm = mmkv.Session(handle, store=store, encoder_store=encoder_store)
    for image in images:
        warm.add_image(image)
    warm.next_token_logits("Describe the screens.")
    return store, encoder_store


def _one_image_arms(handle, image, store, encoder_store, images: int = 1) -> dict:
    """Arms for one cached screenshot (or ``images`` of them) after the preamble, and the text-only turn."""

    def arm(policy: str):
        def build() -> float:
            session = mmkv.Session(
                handle,
                store=store,
                encoder_store=encoder_store,
                reuse="none" if policy == "text-only" else policy,
            )
            session.add_text(PREAMBLE)
            if policy != "text-only":
                for shot in image if isinstance(image, list) else [image]:
                    session.add_image(shot)
            return _ttft_ms(handle, session, QUESTION)

        return build

    return {policy: arm(policy) for policy in (*POLICIES, "text-only")}


def _measured(arms: dict, repeats: int) -> dict[str, Timing]:
    return interleave(arms, repeats, measure=lambda name, fn: fn())


def image_sizes(handle: mmkv.ModelHandle, sizes: list[int], repeats: int) -> list[dict]:
    """TTFT per policy for one cached screenshot after a different preamble, per image size (interleaved)."""
    rows = []
    for size in tqdm(sizes, desc="image sizes", leave=False):
        image = synthetic_screenshot(1000 + size, (size, size))
        store, encoder_store = _stored(handle, [image])
        timings = _measured(_one_image_arms(handle, image, store, encoder_store), repeats)
        probe = mmkv.Session(handle, reuse="none")
        probe.add_image(image)
        t = {k: v.median for k, v in timings.items()}
        rows.append(
            {
                "size": size,
                "image_tokens": probe.prompt_layout(QUESTION).num_tokens - _text_only_tokens(handle),
                "ttft": t,
                "ttft_range": {k: v.as_dict() for k, v in timings.items()},
                "speedup_kv": t["none"] / t["kv"],
                "speedup_encoder": t["none"] / t["encoder"],
                "kv_over_text_only": t["kv"] / t["text-only"],
            }
        )
    return rows


def _text_only_tokens(handle) -> int:
    return mmkv.Session(handle).prompt_layout(QUESTION).num_tokens


def window_slide(handle: mmkv.ModelHandle, turns: int, window: int, size: int) -> dict:
    """A windowed trajectory whose screenshots are all stored already: at every turn where the window slides,
    the ``kv`` turn against the same turn of the conversation without screenshots (lockstep, rotating order)."""
    shots = _shots(turns, size, seed=500)
    store, encoder_store = _stored(handle, shots)
    sessions = {
        "kv": mmkv.Session(handle, store=store, encoder_store=encoder_store, window=window),
        "text-only": mmkv.Session(handle, reuse="none"),
    }
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for session in sessions.values():
        session.add_text(SYSTEM, role="system")
    for turn in range(turns):
        for name in list(sessions) if turn % 2 == 0 else reversed(list(sessions)):
            session = sessions[name]
            session.add_text(f"Step {turn}: here is the screen.")
            if name == "kv":
                session.add_image(shots[turn])
            ms = _ttft_ms(handle, session, "What is the next action?")
            if turn >= window:  # the oldest screenshot just left: everything after it moved
                times[name].append(ms)
            session.add_text("What is the next action?")
            session.add_text(f"click(button_{turn})", role="assistant")
    ratios = [k / t for k, t in zip(times["kv"], times["text-only"], strict=True)]
    return {
        "turns": len(ratios),
        "kv": Timing(tuple(times["kv"])).as_dict(),
        "text-only": Timing(tuple(times["text-only"])).as_dict(),
        "ratio": Timing(tuple(ratios)).as_dict() if ratios else None,
        "kv_sources_last_turn": [r.source for r in sessions["kv"].last_prefill.images],
    }


def many_images(handle: mmkv.ModelHandle, count: int, size: int, repeats: int) -> dict:
    """``count`` stored screenshots spliced into one turn (kv) against a text-only turn, interleaved."""
    shots = _shots(count, size, seed=900)
    store, encoder_store = _stored(handle, shots)
    arms = _one_image_arms(handle, shots, store, encoder_store)
    timings = _measured({"kv": arms["kv"], "text-only": arms["text-only"]}, repeats)
    return {
        "images": count,
        "kv": timings["kv"].as_dict(),
        "text-only": timings["text-only"].as_dict(),
        "ratio": timings["kv"].median / timings["text-only"].median,
    }


FIDELITY_ARMS = {
    "encoder": mmkv.SessionConfig.of(reuse="encoder"),
    "kv": mmkv.SessionConfig.of(reuse="kv", seam=1),
    "kv, seam 0": mmkv.SessionConfig.of(reuse="kv", seam=0),
    "kv, temporal-only rotation": mmkv.SessionConfig.of(reuse="kv", seam=0, rotate_axes=(0,)),
    "kv, not rotated": mmkv.SessionConfig.of(reuse="kv", seam=0, rotate=False),
}


def fidelity(handle: mmkv.ModelHandle, size: int) -> dict[str, dict[str, float]]:
    """One screenshot cached after a short preamble, reused after a longer, different one: next-token logit
    cosine and max abs difference of each arm against full recompute (``none``)."""
    import torch.nn.functional as F

    image = synthetic_screenshot(7, (size, size * 3 // 4))
    store, encoder_store = _stored(handle, [image])
    history = (
        "The user asked to open the settings page, then to switch to the dark theme. Here is the screen:"
    )

    def logits(config: mmkv.SessionConfig) -> torch.Tensor:
        session = mmkv.Session(handle, store=store, encoder_store=encoder_store, config=config)
        session.add_text(history)
        session.add_image(image)
        return session.next_token_logits(QUESTION).float()

    reference = logits(mmkv.SessionConfig.of(reuse="none"))
    out = {}
    for arm, config in FIDELITY_ARMS.items():
        got = logits(config)
        out[arm] = {
            "cosine": F.cosine_similarity(got, reference, dim=0).item(),
            "max_abs": (got - reference).abs().max().item(),
            "same_argmax": bool(got.argmax() == reference.argmax()),
        }
    return out


def _range(r: dict) -> str:
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def _print(handle, results: dict) -> None:
    print(
        f"model {handle.name}: {handle.family.name}, {handle.num_layers} LM layers, dtype {handle.dtype}, "
        f"device {handle.device}"
    )
    traj = results.get("trajectory")
    if traj:
        print("\ntrajectory: TTFT per turn (ms), policies in lockstep")
        print("turn " + "".join(f"{p:>10s}" for p in POLICIES) + f"{'kv speedup':>12s}")
        for turn in range(len(traj["ttft"]["none"])):
            t = {p: traj["ttft"][p][turn] for p in POLICIES}
            print(f"{turn:4d} " + "".join(f"{t[p]:10.1f}" for p in POLICIES) + f"{t['none'] / t['kv']:12.2f}")
        mean = traj["mean_ttft_turns_1plus"]
        if mean:
            print(
                f"mean of turns 1+: none {mean['none']:.1f} ms, encoder {mean['encoder']:.1f} ms "
                f"({mean['none'] / mean['encoder']:.2f}x), kv {mean['kv']:.1f} ms ({mean['none'] / mean['kv']:.2f}x)"
            )
        print("store hit rate: " + ", ".join(f"{p} {r:.2f}" for p, r in traj["hit_rate"].items()))
    if results.get("sizes"):
        print("\nimage sizes: one cached screenshot after a different preamble, ms median [min-max]")
        for r in results["sizes"]:
            cells = " ".join(f"{k} {_range(v)}" for k, v in r["ttft_range"].items())
            print(
                f"{r['size']:5d} px {r['image_tokens']:5d} tok  {cells}  kv x{r['speedup_kv']:.2f}  "
                f"enc x{r['speedup_encoder']:.2f}  kv/text {r['kv_over_text_only']:.2f}"
            )
    for key, label in (
        ("slide", "window slide, all screenshots stored"),
        ("many", "many stored screenshots"),
    ):
        part = results.get(key)
        if part and part.get("ratio") is not None:
            ratio = part["ratio"] if isinstance(part["ratio"], float) else part["ratio"]["median"]
            print(
                f"\n{label}: kv {_range(part['kv'])} ms, text-only {_range(part['text-only'])} ms, kv/text {ratio:.2f}"
            )
    fid = results.get("fidelity")
    if fid:
        print("\nfidelity: image cached after one preamble, reused after another; logits vs full recompute")
        print(f"{'arm':28s} {'cosine':>9s} {'max abs':>9s} {'same top-1':>10s}")
        for arm, row in fid.items():
            print(f"{arm:28s} {row['cosine']:9.5f} {row['max_abs']:9.2e} {str(row['same_argmax']):>10s}")


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/session.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser, "tiny-qwen3-vl")
    parser.add_argument("--turns", type=int, default=12, help="trajectory turns (0: skip)")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--shot-size", type=int, default=448, help="trajectory screenshot width in pixels")
    parser.add_argument("--sizes", type=int, nargs="*", default=[224, 448, 896])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per comparison")
    parser.add_argument("--ratios", action="store_true", help="also the window-slide and many-image parts")
    parser.add_argument("--many", type=int, default=32, help="stored screenshots in the many-image part")
    parser.add_argument("--no-fidelity", action="store_true")
    parser.add_argument("--max-pixels", type=int, default=None, help="override the processor's pixel bound")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    handle = load_model(args)
    if args.max_pixels:
        handle.processor.image_processor.size = {
            **dict(handle.processor.image_processor.size),
            "longest_edge": args.max_pixels,
        }
    warm_up(handle)
    results: dict = {"model": handle.name}
    if args.turns:
        results["trajectory"] = trajectory(handle, args.turns, args.window, args.shot_size)
    results["sizes"] = image_sizes(handle, args.sizes, args.repeats) if args.sizes else []
    if args.ratios:
        results["slide"] = window_slide(handle, max(args.turns, 3 * args.window), args.window, args.shot_size)
        results["many"] = many_images(handle, args.many, args.shot_size, args.repeats)
    if not args.no_fidelity:
        results["fidelity"] = fidelity(handle, args.shot_size)
    _print(handle, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
