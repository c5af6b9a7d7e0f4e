"""The whole GPU part in one bounded run: train the small checkpoints on, then the re-rotation and session
benchmarks at real dimensions. On the device every step has its own time bound (the device's time is the
budget) and writes under ``--out`` as it goes, so a run killed at its limit still returns what it finished (and
the last training snapshot). The CPU smoke run (``--smoke``, which the test suite runs) has **no** time bound:
its work is bounded by steps and sizes only (4 training steps, 16 image tokens, one 224 px session), so a busy
machine makes it slower, never a failure.

Steps, in order:

1. ``training/train_small.py`` for both families **side by side** on the one GPU, from the shipped weights
   (``--init``), until the quick held-out estimate reaches ``--target`` in every category, the step bound, or
   the time bound; each run's checkpoint directory is packed into ``OUT/small-<family>.tar`` afterwards (the
   device returns at most 8 files, so a checkpoint travels as one tar);
2. ``bench/rerotate.py --device cuda --dtype bfloat16`` at Qwen2.5-VL-7B and Qwen3-VL-8B dimensions, 256-4096
   image tokens, with the bytes-moved floor -> ``OUT/rerotate.json``;
3. ``bench/session.py --device cuda --dtype bfloat16`` at full depth, random weights, both architectures,
   224-1792 px -> ``OUT/session-<arch>.json``.

Everything printed goes to ``OUT/gpu.log`` too. Run on the device (``bench/gpu.sh`` installs what the image
lacks first)::

    bash bench/gpu.sh                       # on the H200: --out $OUT, about 9 minutes in all
    python bench/gpu.py --smoke --out /tmp/gpu-smoke   # CPU dry run on tiny models (the test suite runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"qwen3_vl": "small-qwen3-vl", "qwen2_5_vl": "small-qwen2.5-vl"}


@dataclass(frozen=True)
class Plan:
    """What one run does and how long each step may take."""

    device: str  # "cuda" (the real run) or "cpu" (smoke)
    dtype: str  # benchmark dtype
    train_steps: int  # step bound per family
    train_minutes: float | None  # time bound of step 1 (both families side by side); None: steps only
    target: float  # stop training once every category's quick estimate reaches this
    checkpoint_every: int  # snapshot (and quick estimate) interval in steps
    snapshot_n: int  # held-out samples per category per snapshot
    eval_n: int  # held-out samples per category for the final report of each run
    rerotate_tokens: tuple[int, ...]  # image tokens for the re-rotation benchmark
    rerotate_seconds: float | None  # time bound of step 2; None: none (bounded by its sizes)
    session_archs: tuple[str, ...]  # reference architectures (or model names in smoke mode) for step 3
    session_sizes: tuple[int, ...]  # image sides in pixels
    session_seconds: float | None  # time bound of each step-3 run; None: none (bounded by its sizes)
    smoke: bool  # tiny models, a handful of steps

    def __post_init__(self) -> None:
        if self.train_steps < 1 or not 0 < self.target <= 1:
            raise ValueError(f"bad training bounds in {self}")
        for bound in (self.train_minutes, self.rerotate_seconds, self.session_seconds):
            if bound is not None and bound <= 0:
                raise ValueError(f"time bounds must be positive or None in {self}")


REAL = Plan(
    device="cuda",
    dtype="bfloat16",
    train_steps=20000,
    train_minutes=4.5,
    target=0.9,
    checkpoint_every=500,
    snapshot_n=50,
    eval_n=100,
    rerotate_tokens=(256, 1024, 2304, 4096),
    rerotate_seconds=45,
    session_archs=("qwen2.5-vl-7b", "qwen3-vl-8b"),
    session_sizes=(224, 448, 896, 1344, 1792),
    session_seconds=90,
    smoke=False,
)
SMOKE = Plan(
    device="cpu",
    dtype="float32",
    train_steps=4,
    train_minutes=None,  # the smoke run is bounded by its steps and sizes, never by the clock
    target=1.0,
    checkpoint_every=2,
    snapshot_n=2,
    eval_n=2,
    rerotate_tokens=(16,),
    rerotate_seconds=None,
    session_archs=("tiny-qwen3-vl",),
    session_sizes=(224,),
    session_seconds=None,
    smoke=True,
)


class Log:
    """Prints and appends to ``OUT/gpu.log`` (flushed per line, so a killed run keeps its log)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _run(command: list[str], seconds: float | None, log: Log, label: str) -> int:
    """Run ``command`` from the repository root, with a wall-clock bound unless ``seconds`` is None; returns its
    exit status (124 when killed at the bound). Its output goes to the log."""
    started = time.time()
    log(f"== {label}: {' '.join(command)} (bound {'none' if seconds is None else f'{seconds:.0f} s'})")
    with open(log.path, "a", encoding="utf-8") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=_env())
        try:
            status = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            status = 124
    log(f"== {label}: exit {status} after {time.time() - started:.1f} s")
    return status


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def train_both(plan: Plan, out: Path, log: Log) -> dict[str, dict]:
    """Step 1: both families side by side, each into ``out/work/<name>``, packed into ``out/<name>.tar``."""
    work = out / "work"
    processes, started = {}, time.time()
    # 0.85 of the bound leaves the final eval and save inside it; no flag: the step bound alone
    time_bound = [] if plan.train_minutes is None else [f"--max-minutes={plan.train_minutes * 0.85}"]
    for family, name in FAMILIES.items():
        target_dir = work / name
        target_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "training/train_small.py",
            f"--family={family}",
            f"--init={ROOT / 'checkpoints' / name}",
            f"--out={target_dir}",
            f"--device={plan.device}",
            f"--steps={plan.train_steps}",
            *time_bound,
            f"--target={plan.target}",
            f"--checkpoint-every={plan.checkpoint_every}",
            f"--snapshot-n={plan.snapshot_n}",
            f"--eval-n={plan.eval_n}",
            "--lr=1e-3",
            *(["--batch-size=2", "--tool-batch=1"] if plan.smoke else []),  # tool episodes are ~1,000 tokens
        ]
        log(f"== train {name}: {' '.join(command)}")
        sink = open(work / f"train-{name}.log", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=_env())
        processes[name] = (process, sink)
    results = {}
    for name, (process, sink) in processes.items():
        elapsed = time.time() - started
        remaining = None if plan.train_minutes is None else max(1.0, 60 * plan.train_minutes - elapsed)
        try:
            status = process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            status = 124
        sink.close()
        tail = (work / f"train-{name}.log").read_text(errors="replace").splitlines()[-30:]
        log("\n".join(f"   [{name}] {line}" for line in tail))
        directory = work / name
        report = directory / "training_report.json"
        results[name] = {
            "exit": status,
            "report": json.loads(report.read_text()) if report.is_file() else None,
            "progress": [json.loads(line) for line in (directory / "progress.jsonl").read_text().splitlines()]
            if (directory / "progress.jsonl").is_file()
            else [],
        }
        if (directory / "model.safetensors").is_file():
            with tarfile.open(out / f"{name}.tar", "w") as tar:
                tar.add(directory, arcname=name)
        log(f"== train {name}: exit {status}; {json.dumps(results[name]['progress'][-1:] or None)}")
    return results


def run(plan: Plan, out: Path) -> dict:
    """Every step of ``plan``, writing under ``out``; returns a summary (also written to ``out/summary.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu.log")
    summary: dict = {"plan": plan.__dict__, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if plan.device == "cuda":
        import torch

        summary["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    summary["train"] = train_both(plan, out, log)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["rerotate_exit"] = _run(
        [
            sys.executable,
            "bench/rerotate.py",
            f"--device={plan.device}",
            f"--dtype={plan.dtype}",
            "--tokens",
            *map(str, plan.rerotate_tokens),
            "--repeats=3" if plan.smoke else "--repeats=10",
            f"--json={out / 'rerotate.json'}",
        ],
        plan.rerotate_seconds,
        log,
        "rerotate",
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for arch in plan.session_archs:
        which = ["--model", arch] if plan.smoke else ["--arch", arch]
        summary[f"session_{arch}_exit"] = _run(
            [
                sys.executable,
                "bench/session.py",
                *which,
                f"--device={plan.device}",
                f"--dtype={plan.dtype}",
                "--sizes",
                *map(str, plan.session_sizes),
                "--turns=2" if plan.smoke else "--turns=6",
                "--repeats=2" if plan.smoke else "--repeats=5",
                "--max-pixels=4000000",
                f"--json={out / f'session-{arch}.json'}",
            ],
            plan.session_seconds,
            log,
            f"session {arch}",
        )
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    import shutil

    shutil.rmtree(
        out / "work", ignore_errors=True
    )  # the tars hold the checkpoints; 8 files come back at most
    log("== done")
    return summary


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/gpu.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu")), help="default: $OUT"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU dry run on tiny models, a few steps")
    args = parser.parse_args()
    run(SMOKE if args.smoke else REAL, args.out)
