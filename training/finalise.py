"""Ship a training run: copy its best checkpoint into ``checkpoints/<name>/`` with the run's reports.

The best checkpoint is the snapshot (``step-<N>/``) or the final checkpoint (the run directory itself) whose line
in ``progress.jsonl`` scores highest: half the mean quick held-out VQA accuracy over the categories, half the
per-step tool-call accuracy (ties: the later one). Copied: the checkpoint's files (weights, config, tokenizer,
preprocessor config, chat template), the run's ``progress.jsonl`` and ``training_report.json`` (with
``shipped_step`` added). Nothing is written with ``--dry-run``.

    python training/finalise.py /work/runs/train-qwen3_vl small-qwen3-vl --dry-run
    python training/finalise.py /work/runs/train-qwen3_vl small-qwen3-vl
    python training/finalise.py /work/runs/cont-qwen3_vl small-qwen3-vl --earlier /work/runs/train-qwen3_vl

``--earlier RUN`` (repeatable, oldest first): runs this one continued (``--init`` one of their snapshots); their
progress lines up to the snapshot continued from come first in the shipped ``progress.jsonl`` (steps and seconds
counted on from them, each line tagged with its run), and their settings join ``training_report.json``
(``earlier_runs``), so the shipped learning curve and training time cover every run. The best checkpoint is
chosen from ``run`` only. An earlier RUN may be a copy of a shipped checkpoint (``--init checkpoints/<name>``):
its curve keeps its lines' run tags, and its report's ``earlier_runs`` and its own report join the new one's.

    cp -r checkpoints/small-qwen3-vl /work/runs/shipped-qwen3_vl   # before shipping over it
    python training/finalise.py /work/runs/train-qwen3_vl small-qwen3-vl --earlier /work/runs/shipped-qwen3_vl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

__all__ = ["best_snapshot", "finalise", "score"]

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "preprocessor_config.json", "chat_template.jinja",
)  # fmt: skip


def score(line: dict) -> float:
    """Half the mean quick VQA accuracy, half the per-step tool-call accuracy, of one progress line."""
    vqa = line["heldout_quick"]
    return 0.5 * sum(vqa.values()) / len(vqa) + 0.5 * line["tools_quick"]["step_accuracy"]


def best_snapshot(run: Path) -> tuple[Path, dict]:
    """The best checkpoint directory of ``run`` and its progress line. Raises ``ValueError`` if none."""
    candidates = []
    for line in (json.loads(t) for t in (run / "progress.jsonl").read_text().splitlines() if t.strip()):
        directory = run if line.get("final") else run / f"step-{line['step']:06d}"
        if (directory / "model.safetensors").is_file():
            candidates.append((score(line), line["step"], directory, line))
    if not candidates:
        raise ValueError(f"{run} has no checkpoint with a progress line")
    _, _, directory, line = max(candidates, key=lambda c: (c[0], c[1]))
    return directory, line


def _curve(runs: list[Path]) -> tuple[list[dict], list[dict]]:
    """The progress lines of ``runs`` (oldest first) as one curve, and each run's settings. A run's lines stop
    at the step its successor started from (``init`` naming ``step-<N>``)."""
    lines, settings, step0, seconds0 = [], [], 0, 0.0
    for k, run in enumerate(runs):
        own = [json.loads(t) for t in (run / "progress.jsonl").read_text().splitlines() if t.strip()]
        info = json.loads((run / "settings.json").read_text()) if (run / "settings.json").is_file() else {}
        if not info and (run / "training_report.json").is_file():  # a shipped checkpoint: its own history
            report = json.loads((run / "training_report.json").read_text())
            settings += [*report.pop("earlier_runs", []), {"run": str(run), **report}]
        else:
            settings.append({"run": str(run), **info})
        if len(runs) == 1:
            return own, settings
        if k + 1 < len(runs):
            init = json.loads((runs[k + 1] / "settings.json").read_text()).get("init", "")
            stop = int(Path(init).name.removeprefix("step-")) if Path(init).name.startswith("step-") else None
            own = [line for line in own if stop is None or line["step"] <= stop]
        if k and own and own[0]["step"] == 0:
            own = own[1:]  # a continuation's step 0 is its predecessor's last snapshot again
        for line in own:
            lines.append({**line, "run": line.get("run", run.name), "step": line["step"] + step0,
                          "seconds": round(line.get("seconds", 0.0) + seconds0, 1)})  # fmt: skip
        if own:
            step0, seconds0 = lines[-1]["step"], lines[-1]["seconds"]
    return lines, settings


def finalise(run: Path, name: str, dry_run: bool = False, earlier: list[Path] | None = None) -> Path:
    """Copy ``run``'s best checkpoint and reports into ``checkpoints/<name>`` (the learning curve of ``earlier``
    runs first, see the module docstring); returns the source directory."""
    source, line = best_snapshot(run)
    target = ROOT / "checkpoints" / name
    print(f"best: {source} (step {line['step']}, score {score(line):.3f}) -> {target}")
    if dry_run:
        return source
    target.mkdir(parents=True, exist_ok=True)
    for file in CHECKPOINT_FILES:
        if (source / file).is_file():
            # a new file renamed over the old one, never the old one rewritten: a server that has the weights
            # memory-mapped keeps reading the file it opened (truncating it in place killed one with SIGBUS)
            partial = target / f".{file}.partial"
            shutil.copy2(source / file, partial)
            os.replace(partial, target / file)
    lines, settings = _curve([*(earlier or []), run])
    (target / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = json.loads((run / "training_report.json").read_text())
    report["shipped_step"] = line["step"]
    report["earlier_runs"] = settings[:-1]
    report["total_seconds"] = lines[-1].get("seconds") if lines else None
    report["shipped_quick"] = {"heldout_quick": line["heldout_quick"], "tools_quick": line["tools_quick"]}
    (target / "training_report.json").write_text(json.dumps(report, indent=1))
    return source


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, help="the run directory (train_small.py --out)")
    parser.add_argument("name", choices=["small-qwen3-vl", "small-qwen2.5-vl"])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--earlier", type=Path, action="append", default=[], help="a run this one continued")
    args = parser.parse_args()
    sys.exit(0 if finalise(args.run, args.name, args.dry_run, args.earlier) else 1)
