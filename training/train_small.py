"""Train the small shipped checkpoints on the extended task suite and on tool-using desktop episodes.

The models are the real transformers classes (Qwen2.5-VL, Qwen3-VL) shrunk to a few million parameters
(``training/model.py``). Each step draws a batch of suite samples (every category, ``MIX``; answer-only loss,
rendered by ``mmkv.Session``) and a batch of desktop episode steps (``training/data.py``: the messages an agent
resends, tools declared, a window of 2-4 screenshots in tool or user messages, rendered through the stock chat
template; the loss on the hermes tool calls). The step's loss is the mean answer-token loss of the first plus
the mean tool-call-token loss of the second (gradients accumulated over forward calls of similar lengths: one
per episode step, so a 2,000-token prompt never pads a 1,000-token one). Continue from shipped weights with ``--init`` (the chat template
and image bounds are brought up to date, the tokenizer kept).

Run::

    python training/train_small.py --family qwen3_vl --init checkpoints/small-qwen3-vl --out /work/runs/train-qwen3 \
        --max-minutes 300 --checkpoint-minutes 40                       # the real run: time-bounded
    python training/train_small.py --family qwen3_vl --init checkpoints/small-qwen3-vl --out /tmp/smoke \
        --steps 300 --checkpoint-every 100 --snapshot-n 20 --snapshot-episodes 10   # prove the pipeline
    python training/train_small.py --family qwen2_5_vl --steps 3000 --out /tmp/fresh   # from scratch

Outputs in ``--out``: the final checkpoint itself (a standard directory ``mmkv.load`` reads), ``step-<N>/``
snapshots (the same), ``progress.jsonl`` (one line per snapshot: losses, step time, quick held-out estimates per
VQA category and per-step tool-call accuracy, ``training/quick_eval.py``; the last line is the final evaluation on
``--eval-n`` samples per category and ``--eval-n`` / 4 episodes) and ``training_report.json`` (settings, results).
``--target`` stops at the first snapshot whose every quick estimate (each VQA category and the per-step tool-call
accuracy) reaches it.
``--max-minutes`` bounds the run in wall time: the cosine schedule advances by whichever of the step and the time
fraction is further along, so a time-bounded run still ends at a low learning rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script from anywhere: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from evals.preambles import STYLES, make_preamble
from evals.tasks import TRAINING_CATEGORIES, iter_samples
from mmkv.envs import expert_episode
from mmkv.model.handle import ModelHandle
from training.data import collate, encode_episode_step, encode_sample
from training.model import OUT_NAMES, build_model, load_for_training
from training.quick_eval import tool_accuracy, vqa_accuracy

__all__ = ["MIX", "schedule_progress", "train"]

# Share of each category in a suite batch: the agentic tasks are learnt fastest, so the rest get more of the data.
MIX = {
    "perception": 0.2, "reasoning": 0.2, "trajectory": 0.22, "multihop": 0.22, "agentic": 0.1, "agentic_text": 0.06,
}  # fmt: skip
DENSE = 6  # more questions about the same turns asked per suite sample (``encode_sample``; 0: the eval's one)
PREAMBLE_SHARE = 0.3  # agentic samples whose policy follows a preamble (the compose eval's ``use`` direction)
PREAMBLE_TOKENS = (32, 2300)  # its length, log-uniform in this range (the compose eval asks 64-2048)
PREAMBLE_POOL = 96  # distinct training preambles (drawn once; seeds apart from every eval's)
PREAMBLE_SEED_BASE = 20_000_000
HISTORY_SHARE = 0.5  # episode steps drawn among the history-dependent ones (where the episode has any)
WINDOWS = {3: 0.6, 2: 0.2, 4: 0.2}  # screenshots kept in a training episode's prompt (agents default to 3)
SUITE_CHUNK = 4  # suite samples per forward call (sorted by length); episode steps run one per call
EPISODE_SEED_BASE = 10_000_000  # training episodes use seeds from here on (the split keeps pictures apart)


def schedule_progress(step: int, steps: int, elapsed_s: float, max_seconds: float | None) -> float:
    """How far along the run is, in [0, 1]: the step fraction, or the time fraction when that is further.

    >>> schedule_progress(50, 100, 30.0, 60.0), schedule_progress(50, 100, 45.0, 60.0)
    (0.5, 0.75)
    """
    fraction = step / steps
    if max_seconds:
        fraction = max(fraction, elapsed_s / max_seconds)
    return min(1.0, fraction)


class _Batches:
    """Endless training batches: suite samples by ``MIX`` and episode steps, deterministic per seed."""

    def __init__(self, handle: ModelHandle, seed: int, offset: int) -> None:
        self.handle, self.rng = handle, random.Random(seed)
        self.streams = {c: iter_samples(c, seed + offset, "train") for c in TRAINING_CATEGORIES}
        self.next_episode = EPISODE_SEED_BASE + 1000 * seed + 7919 * offset
        low, high = (math.log(t) for t in PREAMBLE_TOKENS)
        tokenizer = handle.processor.tokenizer
        self.preambles = [
            make_preamble(tokenizer, round(math.exp(self.rng.uniform(low, high))), PREAMBLE_SEED_BASE + 97 * seed
                          + i, STYLES[i % len(STYLES)])
            for i in range(PREAMBLE_POOL)
        ]  # fmt: skip

    def suite(self, size: int) -> list[dict]:
        drawn = self.rng.choices(list(MIX), list(MIX.values()), k=size)
        out = []
        for category in drawn:
            sample = next(self.streams[category])
            if sample.system and self.rng.random() < PREAMBLE_SHARE:
                sample = dataclasses.replace(sample, system=self.rng.choice(self.preambles) + sample.system)
            out.append(encode_sample(self.handle, sample, DENSE, self.rng))
        return out

    def tools(self, size: int) -> list[dict]:
        out = []
        for _ in range(size):
            episode = expert_episode(self.next_episode, "train")
            self.next_episode += 1
            history = [j for j, step in enumerate(episode.steps) if step.uses_history]
            use_history = history and self.rng.random() < HISTORY_SHARE
            k = self.rng.choice(history) if use_history else self.rng.randrange(len(episode.steps))
            window = self.rng.choices(list(WINDOWS), list(WINDOWS.values()))[0]
            out.append(
                encode_episode_step(self.handle, episode, k, self.rng.choice(("tool", "user")), window)
            )
        return out


def _backward(handle: ModelHandle, batch: list[dict], chunk: int, device: str) -> float:
    """Back-propagate the mean label-token cross-entropy of ``batch`` (gradients accumulate in the model) and
    return it. The examples run in chunks of ``chunk`` of similar length (sorted), so little is padding; each
    chunk's loss is weighted by its share of the label tokens."""
    if not batch:
        return 0.0
    batch = sorted(batch, key=lambda b: int(b["ids"].shape[0]))
    total = sum(int((b["labels"][1:] != -100).sum()) for b in batch)  # labels the model's shifted loss reads
    mean = 0.0
    for begin in range(0, len(batch), chunk):
        part = batch[begin : begin + chunk]
        share = sum(int((b["labels"][1:] != -100).sum()) for b in part) / total
        inputs = {name: tensor.to(device) for name, tensor in collate(handle, part).items()}
        loss = handle.model(**inputs).loss * share
        handle.model.model.rope_deltas = None
        loss.backward()
        mean += loss.item()
    return mean


def _snapshot(
    handle: ModelHandle, out: Path, line: dict, snapshot_n: int, episodes: list, save: bool
) -> dict:
    """Quick held-out estimates (and, with ``save``, a checkpoint in ``out/step-<N>``) appended to
    ``out/progress.jsonl``; returns the line written."""
    started = time.time()
    line = line | {
        "heldout_quick": vqa_accuracy(handle, snapshot_n),
        "tools_quick": tool_accuracy(handle, episodes),
    }
    line["eval_seconds"] = round(time.time() - started, 1)
    if save:
        ModelHandle.from_parts(handle.name, handle.model, handle.processor, handle.family).save(
            out / f"step-{line['step']:06d}"
        )
    with open(out / "progress.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)
    handle.model.train()
    return line


def train(
    family: str,
    out: Path,
    *,
    init: Path | None = None,
    steps: int = 100_000,
    batch_size: int = 8,
    tool_batch: int = 4,
    lr: float = 1e-3,
    seed: int = 0,
    max_minutes: float | None = None,
    checkpoint_every: int = 0,
    checkpoint_minutes: float | None = None,
    snapshot_n: int = 30,
    snapshot_episodes: int | None = None,
    eval_n: int = 100,
    target: float | None = None,
    warmup: int | None = None,
    device: str = "cpu",
) -> dict:
    """Train (from scratch, or on from the checkpoint ``init``) and save into ``out``; returns the report written
    to ``out/training_report.json``.

    Stops after ``steps`` steps or ``max_minutes`` of wall time (the schedule is time-aware, see
    ``schedule_progress``). Snapshots (a checkpoint and quick estimates) at the start, every
    ``checkpoint_every`` steps and every ``checkpoint_minutes`` of wall time, whichever comes first, and at the
    end (on ``eval_n`` samples per category and ``eval_n // 4`` episodes; the checkpoint saved into ``out``
    itself). ``target`` stops at the first snapshot whose every quick estimate reaches it; ``snapshot_episodes``
    defaults to ``snapshot_n // 2``."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    handle = build_model(family, seed) if init is None else load_for_training(init, device)
    if handle.family.name != family:
        raise ValueError(f"--family {family} but {init} is a {handle.family.name} checkpoint")
    model = handle.model.to(device)
    previous = (
        json.loads((init / "training_report.json").read_text())
        if init is not None and (init / "training_report.json").is_file()
        else {}
    )
    offset = previous.get("total_steps", 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = min(200, max(1, steps // 30)) if warmup is None else max(1, warmup)
    max_seconds = None if max_minutes is None else 60.0 * max_minutes
    started = time.time()
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * schedule_progress(s, steps, time.time() - started, max_seconds))),
    )  # fmt: skip
    batches = _Batches(handle, seed, offset)
    snapshot_episodes = max(1, snapshot_n // 2) if snapshot_episodes is None else snapshot_episodes
    episodes = [expert_episode(i, "heldout") for i in range(snapshot_episodes)]
    settings = {
        "family": family, "init": None if init is None else str(init), "steps": steps, "batch_size": batch_size,
        "tool_batch": tool_batch, "lr": lr, "warmup": warmup, "seed": seed, "max_minutes": max_minutes,
        "checkpoint_every": checkpoint_every, "checkpoint_minutes": checkpoint_minutes, "mix": MIX,
        "windows": WINDOWS, "snapshot_n": snapshot_n, "snapshot_episodes": snapshot_episodes, "eval_n": eval_n,
        "target": target, "dense": DENSE, "preamble_share": PREAMBLE_SHARE, "preamble_tokens": PREAMBLE_TOKENS,
        "history_share": HISTORY_SHARE,
        "torch_threads": torch.get_num_threads(), "image_bounds": handle.processor.pixel_bounds,
    }  # fmt: skip
    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    lines = [_snapshot(handle, out, {"step": 0, "seconds": 0.0}, snapshot_n, episodes, save=False)]
    losses: dict[str, list[float]] = {"suite": [], "tool": []}
    step_seconds: list[float] = []
    last_snapshot, stopped_by, done = time.time(), "steps", 0
    model.train()
    for step in range(steps):
        tick = time.time()
        optimizer.zero_grad(set_to_none=True)
        losses["suite"].append(_backward(handle, batches.suite(batch_size), SUITE_CHUNK, device))
        losses["tool"].append(_backward(handle, batches.tools(tool_batch), 1, device))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step_seconds.append(time.time() - tick)
        done = step + 1
        elapsed = time.time() - started
        if max_seconds is not None and elapsed >= max_seconds:
            stopped_by = "time"
            break
        due = (checkpoint_every and done % checkpoint_every == 0) or (
            checkpoint_minutes and time.time() - last_snapshot >= 60 * checkpoint_minutes
        )
        if due and done < steps:
            recent = {k: sum(v[-100:]) / len(v[-100:]) for k, v in losses.items()}
            line = {"step": done, "seconds": round(elapsed, 1), "loss_suite": recent["suite"], "loss_tool": recent["tool"],
                    "lr": schedule.get_last_lr()[0], "step_seconds": sum(step_seconds[-100:]) / len(step_seconds[-100:])}  # fmt: skip
            lines.append(_snapshot(handle, out, line, snapshot_n, episodes, save=True))
            last_snapshot = time.time()
            quick = [*lines[-1]["heldout_quick"].values(), lines[-1]["tools_quick"]["step_accuracy"]]
            if target is not None and min(quick) >= target:
                stopped_by = "target"
                break
    train_seconds = time.time() - started
    recent = {k: sum(v[-100:]) / max(1, len(v[-100:])) for k, v in losses.items()}
    line = {"step": done, "seconds": round(train_seconds, 1), "loss_suite": recent["suite"], "loss_tool": recent["tool"],
            "step_seconds": sum(step_seconds[-100:]) / max(1, len(step_seconds[-100:])), "final": True}  # fmt: skip
    final_episodes = [expert_episode(i, "heldout") for i in range(max(1, eval_n // 4))]
    lines.append(_snapshot(handle, out, line | {"eval_n": eval_n}, eval_n, final_episodes, save=False))
    ModelHandle.from_parts(handle.name, model.eval(), handle.processor, handle.family).save(out)
    report = {
        **settings,
        "params": sum(p.numel() for p in model.parameters()),
        "steps_done": done,
        "stopped_by": stopped_by,  # "steps", "time" (max_minutes) or "target"
        "train_seconds": round(train_seconds, 1),
        "median_step_seconds": sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else None,
        "final": lines[-1],
        "total_steps": offset + done,  # over every --init continuation
        "total_train_seconds": round(previous.get("total_train_seconds", 0) + train_seconds, 1),
        "history": [
            *previous.get("history", []),
            {
                "steps": done,
                "lr": lr,
                "suite": "extended (multihop, 256 px)"
                if not DENSE
                else "dense questions, preambles, history steps",
                "tools": True,
                "final": lines[-1],
            },
        ],  # fmt: skip
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    return report


def build_parser() -> argparse.ArgumentParser:
    """The command line (parsed only under ``__main__``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=sorted(OUT_NAMES), default="qwen3_vl")
    parser.add_argument("--out", type=Path, required=True, help="run directory (never checkpoints/ itself)")
    parser.add_argument("--init", type=Path, default=None, help="continue training this checkpoint directory")
    parser.add_argument("--steps", type=int, default=100_000, help="step bound (the schedule's length)")
    parser.add_argument("--batch-size", type=int, default=8, help="suite samples per step")
    parser.add_argument("--tool-batch", type=int, default=4, help="desktop episode steps per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="stop (and decay the lr) by this time"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="snapshot every N steps (0: by time only)"
    )
    parser.add_argument("--checkpoint-minutes", type=float, default=None, help="snapshot every M minutes")
    parser.add_argument(
        "--snapshot-n", type=int, default=30, help="held-out samples per category per snapshot"
    )
    parser.add_argument("--snapshot-episodes", type=int, default=None, help="held-out episodes per snapshot")
    parser.add_argument(
        "--eval-n", type=int, default=100, help="final held-out samples per category (n/4 episodes)"
    )
    parser.add_argument(
        "--target", type=float, default=None, help="stop once every quick estimate reaches this"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (default: min(200, steps/30))"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    return parser


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("training/train_small.py")
    args = vars(build_parser().parse_args())
    torch.set_num_threads(args.pop("threads"))
    print(json.dumps(train(args.pop("family"), args.pop("out"), **args), indent=1))
