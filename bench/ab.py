"""Before/after in one run: the same benchmark command against two source trees, alternating (A B A B ...).

Each round runs the command once per tree, in a fresh process whose ``PYTHONPATH`` puts that tree first (so
``import mmkv`` is that tree's), with ``{json}`` in the command replaced by a file the command writes its figures
to. Every numeric leaf of that JSON (lists flattened as ``key.0``, ``key.1``, ...) is collected per tree;
the summary prints each one's median with min-max per tree and the after/before ratio. Example::

    git worktree add /tmp/before <commit>
    python bench/ab.py --trees /tmp/before . --rounds 5 --keys trajectory.ttft -- \\
        bench/session.py --turns 12 --sizes --json {json}

The command's script is taken from the *last* tree, so both trees run the same benchmark code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def flatten(value, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value: ``{"a": {"b": [1, 2]}}`` -> ``{"a.b.0": 1, "a.b.1": 2}``."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: dict[str, float] = {}
    for key, child in items:
        out |= flatten(child, f"{prefix}.{key}" if prefix else str(key))
    return out


def run(trees: list[Path], command: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    """``{tree: {key: [value per round]}}`` from alternating runs of ``command`` in each tree."""
    results: dict[str, dict[str, list[float]]] = {str(t): {} for t in trees}
    script_tree = trees[-1]
    for round_ in range(rounds):
        order = trees if round_ % 2 == 0 else list(reversed(trees))
        for tree in order:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "out.json"
                argv = [str(script_tree / command[0]), *(a.replace("{json}", str(out)) for a in command[1:])]
                env = dict(os.environ, PYTHONPATH=str(tree))
                subprocess.run(
                    [sys.executable, *argv],
                    env=env,
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for key, value in flatten(json.loads(out.read_text())).items():
                    results[str(tree)].setdefault(key, []).append(value)
    return results


def summary(results: dict[str, dict[str, list[float]]], keys: list[str]) -> list[str]:
    """One line per key: each tree's median [min-max], and the last tree's median over the first's."""
    trees = list(results)
    lines = [
        f"{'key':40s} " + " ".join(f"{Path(t).name or t:>26s}" for t in trees) + f" {'after/before':>12s}"
    ]
    for key in sorted(results[trees[0]]):
        if keys and not any(key.startswith(k) for k in keys):
            continue
        cells, medians = [], []
        for tree in trees:
            values = results[tree].get(key, [])
            if not values:
                cells.append(f"{'-':>26s}")
                continue
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:12.4g} [{min(values):.4g}-{max(values):.4g}]".rjust(26))
        ratio = medians[-1] / medians[0] if len(medians) == len(trees) and medians[0] else float("nan")
        lines.append(f"{key:40s} " + " ".join(cells) + f" {ratio:12.3f}")
    return lines


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/ab.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trees", type=Path, nargs=2, required=True, help="before and after source trees")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", nargs="*", default=[], help="only report keys starting with these")
    parser.add_argument("--json", help="also write every sample here")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- script.py args ({json}: its output file)"
    )
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    results = run([t.resolve() for t in args.trees], command, args.rounds)
    print("\n".join(summary(results, args.keys)))
    if args.json:
        Path(args.json).write_text(json.dumps(results))
