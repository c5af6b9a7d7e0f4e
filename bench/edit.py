"""Cost of each field-edit strategy (``mmkv.text.edit``) in one long context, measured side by side.

The context is an agent's: a policy with an editable field near the start, then ``--shots`` screenshots with a
line of text each (the field is early, so everything after it is most of the context: the case the cheap
strategies exist for). Per strategy: tokens recomputed, fraction of the context, edit time (median with min-max
of ``--repeats`` rounds) and its ratio to ``full``. The strategies are interleaved (every round runs each once,
the order rotated each round: A B C, B C A, ...), each edit on a freshly prefilled session (not timed).

Run::

    python bench/edit.py                                            # tiny-qwen3-vl on the CPU
    python bench/edit.py --arch qwen2.5-vl-7b --lm-layers 4 --vision-layers 2 --shots 3
    python bench/edit.py --arch qwen3-vl-8b --device cuda --dtype bfloat16 --shots 6

Times are wall-clock and machine-dependent; the ratios are what to read. Random weights are fine here: cost
does not depend on what the model decides.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import mmkv  # noqa: E402
from bench.models import add_model_arguments, load_model  # noqa: E402
from bench.timing import interleave  # noqa: E402
from mmkv.synthetic import synthetic_screenshot  # noqa: E402
from mmkv.text import STRATEGIES  # noqa: E402

POLICY = (
    "Policy. account_role: {role}. If the status badge is red: an admin answers click(approve), anyone else "
    "answers escalate(ticket). If the badge is green: answer click(submit) when the form field is filled, "
    "else fill(field)."
)
ARMS = [(s, {}) for s in STRATEGIES if s != "selective"] + [
    ("selective", {"k": 8, "rank": "attention"}),
    ("selective", {"k": 8, "rank": "deviation"}),
]


def _context(handle: mmkv.ModelHandle, shots: int, size: int) -> mmkv.Session:
    session = mmkv.Session(handle, reuse="none")
    session.add_text(POLICY, role="system", fields={"role": "admin"})
    for i in range(shots):
        session.add_image(synthetic_screenshot(i, (size, size * 3 // 4)))
        session.add_text(f"Screen {i + 1}: the dialog is open and waiting.")
    session.prefill()
    return session


def run(handle: mmkv.ModelHandle, shots: int, size: int, repeats: int) -> list[dict]:
    """One row per strategy: name, tokens recomputed, context tokens, fraction and the edit time (median, min,
    max in ms), the strategies interleaved round by round."""
    _context(handle, 1, 224).edit("role", "viewer", "full")  # warm-up, discarded
    reports = {}

    def arm(strategy: str, options: dict, name: str):
        def edit_ms() -> float:
            session = _context(handle, shots, size)  # not timed
            if handle.device.type == "cuda":
                torch.cuda.synchronize()
            reports[name] = session.edit("role", "viewer", strategy, **options)
            return 1e3 * reports[name].seconds

        return edit_ms

    names = [s if s != "selective" else f"selective k={o['k']} ({o['rank']})" for s, o in ARMS]
    arms = {name: arm(s, o, name) for name, (s, o) in zip(names, ARMS, strict=True)}
    timings = interleave(arms, repeats, warmup=False, measure=lambda name, fn: fn())
    full = timings["full"].median
    return [
        {
            "strategy": name,
            "recomputed": reports[name].recomputed,
            "context_tokens": reports[name].context_tokens,
            "fraction": reports[name].fraction,
            "edit_ms": timings[name].as_dict(),
            "vs_full": timings[name].median / full,
        }
        for name in names
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser, "tiny-qwen3-vl")
    parser.add_argument("--max-pixels", type=int, default=None)
    parser.add_argument("--shots", type=int, default=3, help="screenshots after the policy")
    parser.add_argument("--size", type=int, default=448, help="screenshot width in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    handle = load_model(args)
    rows = run(handle, args.shots, args.size, args.repeats)
    full = next(r for r in rows if r["strategy"] == "full")
    print(f"{args.arch or args.model}: context of {full['context_tokens']} tokens, field near the start")
    print("| strategy | tokens recomputed | fraction | edit ms, median [min-max] | vs full |")
    print("|---|---|---|---|---|")
    for r in rows:
        t = r["edit_ms"]
        print(
            f"| {r['strategy']} | {r['recomputed']} | {r['fraction']:.3f} | "
            f"{t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] | {r['vs_full']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/edit.py")
    main()
