"""Time to first token of a turn that splices a precompiled L-token text segment against one that computes it.

For each ``--lengths`` L: a text of L tokens (notes, as in ``evals/compose.py``) is precompiled once
(``mmkv.text.precompile``, untimed), then two arms run interleaved (A B A B ..., order rotated each round,
``--repeats`` rounds after an untimed one), each a fresh session: a short system message, the text as the
user's, a question.

- ``splice``: ``add_segment(segment, seam=1)``: the segment re-rotated to its place, one token recomputed, the
  question attending over it; O(L) work;
- ``compute``: ``reuse="none"``, the text prefilled with everything else; O(L^2) attention on top of O(L)
  projections.

TTFT is ``last_prefill.seconds`` (rendering to first-token logits on the host). The growth of each arm is the
slope of log TTFT against log L (least squares over L >= ``--fit-from``): 1 is linear, 2 quadratic.

**Store side** (``--store-length``): a child process precompiles a segment into a disk-tier store and exits;
this process opens the directory, loads the segment (``precompile(..., store=...)`` finds it), checks that its
keys and values equal the ones computed here bit for bit, and times load + splice against computing.

    python bench/compose.py                              # tiny-qwen3-vl, L = 512 .. 32768
    python bench/compose.py --arch qwen2.5-vl-7b --lm-layers 1 --vision-layers 1 --lengths 512 1024 2048
    python bench/compose.py --smoke --json /tmp/c.json   # seconds: what the test suite runs

The tiny models are built with 4096 positions; for longer L the bench raises ``max_position_embeddings`` of the
loaded model's text config (rotary angles are computed from positions, so nothing else changes).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable (for bench.timing)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import mmkv
from bench.models import add_model_arguments, load_model, model_arguments
from bench.timing import interleave
from evals.preambles import make_preamble
from mmkv.cache import KVStore

SYSTEM = "You are an agent. The user's notes follow."
QUESTION = "Which page was opened last? Answer with one word."
ROOT = Path(__file__).resolve().parents[1]


def segment_text(handle: mmkv.ModelHandle, length: int, seed: int = 0) -> str:
    """Notes of at least ``length`` tokens (seeded), the blank line at the end removed."""
    return make_preamble(handle.processor.tokenizer, length, seed).rstrip("\n")


def _turn(handle: mmkv.ModelHandle, text: str, segment, arm: str) -> float:
    """One fresh session's first-token time in ms: the text spliced (``arm="splice"``) or computed."""
    session = mmkv.Session(handle, reuse="kv" if arm == "splice" else "none")
    session.add_text(SYSTEM, "system")
    if arm == "splice":
        session.add_segment(segment, seam=1)
    else:
        session.add_text(text)
    session.next_token_logits(QUESTION)
    if arm == "splice":
        assert session.last_prefill.reused >= segment.length - 1, "the segment was not spliced"
    return 1e3 * session.last_prefill.seconds


def lengths_part(handle: mmkv.ModelHandle, lengths: list[int], repeats: int) -> list[dict]:
    """Per L: both arms' TTFT (median, min, max in ms) and the ratio of medians."""
    rows = []
    for length in lengths:
        text = segment_text(handle, length)
        try:
            started = time.perf_counter()
            segment = mmkv.text.precompile(handle, text)
            precompile_ms = 1e3 * (time.perf_counter() - started)
            timings = interleave(
                {
                    arm: (lambda arm=arm, text=text, segment=segment: _turn(handle, text, segment, arm))
                    for arm in ("splice", "compute")
                },
                repeats,
                measure=lambda name, fn: fn(),
            )
        except (MemoryError, RuntimeError) as exc:  # this machine's limit: report it, keep what was measured
            print(f"L {length}: stopped, {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            break
        rows.append(
            {
                "length": segment.length,
                "precompile_ms": precompile_ms,
                **{arm: t.as_dict() for arm, t in timings.items()},
                "ratio": timings["compute"].median / timings["splice"].median,
            }
        )
        print(
            f"L {segment.length:6d}  splice {timings['splice']}  compute {timings['compute']}  "
            f"x{rows[-1]['ratio']:.2f}",
            flush=True,
        )
    return rows


def growth(rows: list[dict], arm: str, fit_from: int) -> float | None:
    """Least-squares slope of log median TTFT against log L over rows with L >= ``fit_from`` (None if < 2)."""
    points = [(math.log(r["length"]), math.log(r[arm]["median"])) for r in rows if r["length"] >= fit_from]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def _child_precompile(args) -> None:
    """The other process: precompile the segment into the disk store at ``args.child`` and exit."""
    handle = _handle(args)
    store = KVStore(args.child)
    mmkv.text.precompile(handle, segment_text(handle, args.store_length), store=store)
    store.close()


def store_part(handle: mmkv.ModelHandle, args, repeats: int) -> dict:
    """A segment precompiled into a disk store by another process, loaded here: equality and times."""
    with tempfile.TemporaryDirectory() as directory:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            *model_arguments(args),
            "--child",
            directory,
        ]
        command += ["--store-length", str(args.store_length)]
        subprocess.run(command, check=True, cwd=ROOT, timeout=1800)
        text = segment_text(handle, args.store_length)
        local = mmkv.text.precompile(handle, text)
        equal = None

        def load() -> float:
            nonlocal equal
            store = KVStore(directory)  # a fresh store: empty memory tier, the disk tier on the directory
            started = time.perf_counter()
            loaded = mmkv.text.precompile(handle, text, store=store)
            ms = 1e3 * (time.perf_counter() - started)
            equal = bool(torch.equal(loaded.keys, local.keys) and torch.equal(loaded.values, local.values))
            hits = store.stats().disk.hits
            store.close()
            assert hits >= 1, "the segment did not come from the disk tier"
            return ms

        def compute() -> float:
            started = time.perf_counter()
            mmkv.text.precompile(handle, text)
            return 1e3 * (time.perf_counter() - started)

        timings = interleave({"disk load": load, "compute": compute}, repeats, measure=lambda name, fn: fn())
        turn = interleave(
            {arm: (lambda arm=arm: _turn(handle, text, local, arm)) for arm in ("splice", "compute")},
            repeats,
            measure=lambda name, fn: fn(),
        )
    load_ms, splice_ms = timings["disk load"].median, turn["splice"].median
    return {
        "length": local.length,
        "bytes": local.nbytes,
        "equal_to_computed": equal,
        "disk_load": timings["disk load"].as_dict(),
        "precompute": timings["compute"].as_dict(),
        "splice_turn": turn["splice"].as_dict(),
        "compute_turn": turn["compute"].as_dict(),
        "load_plus_splice_vs_compute": turn["compute"].median / (load_ms + splice_ms),
    }


def _handle(args) -> mmkv.ModelHandle:
    """The model, with room for the longest segment (see the module docstring)."""
    return load_model(args, min_positions=2 * max([*args.lengths, args.store_length]) + 1024)


def _range(t: dict) -> str:
    return f"{t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}]"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser, "tiny-qwen3-vl", device="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per length")
    parser.add_argument("--fit-from", type=int, default=2048, help="fit the growth over L >= this")
    parser.add_argument(
        "--store-length", type=int, default=4096, help="segment tokens of the store part (0: skip)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny lengths, one round: seconds")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the store part's other process
    args = parser.parse_args(argv)
    if args.smoke:
        args.lengths, args.repeats, args.fit_from, args.store_length = [64, 128, 256], 1, 64, 128
    if args.child:
        _child_precompile(args)
        return {}
    handle = _handle(args)
    print(
        f"model {handle.name}: {handle.num_layers} LM layers, {handle.dtype}, {torch.get_num_threads()} threads"
    )
    rows = lengths_part(handle, args.lengths, args.repeats)
    results = {
        "model": handle.name,
        "rows": rows,
        "growth": {arm: growth(rows, arm, args.fit_from) for arm in ("splice", "compute")},
        "ratio_at_largest": rows[-1]["ratio"],
    }
    g = results["growth"]
    if g["splice"] is not None:
        print(
            f"growth (log-log slope, L >= {args.fit_from}): splice {g['splice']:.2f}, compute {g['compute']:.2f}"
        )
    print(f"compute / splice at L = {rows[-1]['length']}: {rows[-1]['ratio']:.2f}x")
    if args.store_length:
        part = results["store"] = store_part(handle, args, args.repeats)
        print(
            f"store: {part['length']} tokens precompiled by another process; disk load {_range(part['disk_load'])} "
            f"ms (equal to computed: {part['equal_to_computed']}), computing it {_range(part['precompute'])} ms; "
            f"turn: load + splice vs compute x{part['load_plus_splice_vs_compute']:.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/compose.py")
    main()
