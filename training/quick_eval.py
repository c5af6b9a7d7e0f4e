"""Quick held-out estimates during training: VQA accuracy per category and tool-call accuracy per step.

Both under full recompute, on fixed held-out sets (the same samples and episodes at every snapshot, so the
learning curve compares like with like): ``vqa_accuracy`` answers ``n`` held-out samples per category with an
``mmkv.Session`` (``reuse="none"``, greedy); ``tool_accuracy`` replays held-out desktop episodes step by step
with the right history and scores the model's first tool call (``evals/episodes.py``).
"""

from __future__ import annotations

import torch

from evals.episodes import score_episode
from evals.tasks import TRAINING_CATEGORIES, make_samples, normalise_answer, sample_session
from mmkv.envs import Episode
from mmkv.model.handle import ModelHandle

__all__ = ["tool_accuracy", "vqa_accuracy"]


@torch.no_grad()
def vqa_accuracy(handle: ModelHandle, n: int, seed: int = 0) -> dict[str, float]:
    """Accuracy per category (``TRAINING_CATEGORIES``) on ``n`` held-out samples each, greedy answers."""
    handle.model.eval()
    out = {}
    for category in TRAINING_CATEGORIES:
        samples = make_samples(category, n, seed=seed, split="heldout")
        correct = 0
        for sample in samples:
            answer = sample_session(handle, sample, reuse="none").ask(sample.question, max_new_tokens=8)
            correct += normalise_answer(answer.text) == normalise_answer(sample.answer)
        out[category] = correct / len(samples)
    return out


@torch.no_grad()
def tool_accuracy(handle: ModelHandle, episodes: list[Episode], window: int = 3) -> dict:
    """Per-step accuracy (overall, by decision kind, over the steps that use history) and episode success on
    ``episodes``, screenshots alternating between tool and user messages by episode."""
    handle.model.eval()
    records = []
    for i, episode in enumerate(episodes):
        records += score_episode(handle, episode, ("tool", "user")[i % 2], window)
    by_kind: dict[str, list[bool]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r["correct"])
    history = [r["correct"] for r in records if r["uses_history"]]
    success = [all(r["correct"] for r in records if r["seed"] == e.seed) for e in episodes]
    return {
        "step_accuracy": sum(r["correct"] for r in records) / len(records),
        "episode_success": sum(success) / len(success),
        "history_accuracy": sum(history) / len(history) if history else None,
        "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "steps": len(records),
        "median_prompt_tokens": sorted(r["prompt_tokens"] for r in records)[len(records) // 2],
    }
