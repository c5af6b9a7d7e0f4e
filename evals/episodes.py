"""The episode eval: does the model act right through tools on held-out desktop episodes (full recompute)?

Each held-out episode of ``mmkv.envs.DesktopApp`` (new seeds, pictures never shown in training) is replayed step
by step: the prompt is the message list an agent resends before that step (``Episode.messages``: the policy,
the task, the history of tool calls and results, the last ``--window`` screenshots in tool messages or in user
messages), rendered through the stock path (``processor.apply_chat_template(messages, tools=...)`` then the
processor), the model answers greedily, and its first hermes tool call is compared with the right one. The
history is always the right one (each step is scored on its own), so per-step accuracy is what an agent
corrected at every step would get; an episode succeeds when every one of its steps is right.

Reported per decision kind (approve, escalate, fill, submit, ok, close), for the steps that depend on an earlier
step (a returning ticket, a role signed in again), and overall: per-step accuracy and episode success with exact
(Wilson) 95% intervals, and the prompt's tokens and images per step. Only the reference arm (``none``, full
recompute) is run here; the reuse arms need tool prompts in ``mmkv.Session`` / ``mmkv serve``.

    python evals/episodes.py --model small-qwen3-vl --n 50
    python evals/episodes.py --model tiny-qwen3-vl --n 2 --screenshot-in user --window 2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mmkv  # noqa: E402
from evals.report import (  # noqa: E402
    EPISODE_METRICS,
    cells,
    default_out,
    episode_markdown,
    script_main,
    write_results,
)
from mmkv.cli import HelpFormatter  # noqa: E402
from mmkv.envs import Episode, expert_episode, message_images, parse_tool_calls  # noqa: E402
from mmkv.model.processor import VLProcessor  # noqa: E402

__all__ = ["aggregate", "greedy_text", "heldout_episodes", "run", "score_episode", "step_inputs"]

MAX_CALL_TOKENS = 96  # the longest right call (fill ... viewer) is about 70 tokens with the small tokenizer


def heldout_episodes(n: int, seed: int = 0) -> list[Episode]:
    """``n`` held-out episodes (``DesktopApp("heldout")`` seeds ``seed``, ``seed + 1``, ...)."""
    return [expert_episode(seed + i, "heldout") for i in range(n)]


def step_inputs(
    processor: VLProcessor, messages: list[dict], tools: list[dict] | None
) -> dict[str, torch.Tensor]:
    """Model inputs of a chat-completions message list through the stock path: the chat template (with
    ``tools``) and a generation prompt, then pads expanded and tokenised with the images (``input_ids (1, L)``,
    ``pixel_values``, ``image_grid_thw``, ...)."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return processor(text, message_images(messages))


@torch.inference_mode()
def greedy_text(
    handle: mmkv.ModelHandle, inputs: dict[str, torch.Tensor], max_new_tokens: int = MAX_CALL_TOKENS
) -> str:
    """The model's greedy answer to ``inputs`` (up to ``<|im_end|>`` or ``max_new_tokens``), special tokens
    removed. Uses ``generate`` with the model's own positions; changes no state of the handle."""
    model = handle.model
    model.model.rope_deltas = None  # never continue from another prompt's M-RoPE offsets
    inputs = {k: v.to(handle.device) for k, v in inputs.items()}
    eos = handle.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=handle.tokenizer.pad_token_id,
    )  # fmt: skip
    model.model.rope_deltas = None
    return handle.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def score_episode(
    handle: mmkv.ModelHandle,
    episode: Episode,
    screenshot_in: str = "tool",
    window: int | None = 3,
    max_new_tokens: int = MAX_CALL_TOKENS,
) -> list[dict]:
    """One record per step: the model's answer to the prompt before that step (right history), scored.

    Record fields: ``seed``, ``step``, ``steps`` (in the episode), ``kind``, ``uses_history``, ``expected``
    (the right call, ``click(target=ok)`` form), ``answer`` (raw text), ``called`` (the first parsed call or
    ``""``), ``correct`` (name and arguments equal), ``prompt_tokens``, ``images`` (in the prompt)."""
    tools = episode.tools
    records = []
    for k, step in enumerate(episode.steps):
        messages = episode.messages(k, screenshot_in=screenshot_in, window=window, as_url=False)
        inputs = step_inputs(handle.processor, messages, tools)
        answer = greedy_text(handle, inputs, max_new_tokens)
        calls = parse_tool_calls(answer)
        records.append({
            "seed": episode.seed, "step": k, "steps": len(episode.steps), "kind": step.kind,
            "uses_history": step.uses_history, "expected": str(step.call), "answer": answer,
            "called": str(calls[0]) if calls else "", "correct": bool(calls) and calls[0] == step.call,
            "prompt_tokens": int(inputs["input_ids"].shape[1]), "images": len(message_images(messages)),
        })  # fmt: skip
    return records


def aggregate(records: Sequence[dict], resamples: int = 1000, seed: int = 0) -> dict:
    """``{"steps": {kind | "all" | "uses history": cell}, "episodes": cell}``: per-step cells (``accuracy``
    with a Wilson interval, ``prompt_tokens`` median, ``images`` mean) by decision kind, overall, and over the
    steps that depend on an earlier one; then episode success (every step right) over episodes. Pure."""
    rows = [r | {"arm": "none"} for r in records]
    steps = cells(rows, "arm", "kind", EPISODE_METRICS, resamples, seed)["none"]
    history = [r | {"group": "uses history"} for r in rows if r["uses_history"]]
    if history:
        steps["uses history"] = cells(history, "arm", "group", EPISODE_METRICS, resamples, seed)["none"][
            "all"
        ]
    by_episode: dict[int, bool] = {}
    for r in records:
        by_episode[r["seed"]] = by_episode.get(r["seed"], True) and bool(r["correct"])
    episodes = [{"arm": "none", "group": "all", "correct": ok} for ok in by_episode.values()]
    success = cells(episodes, "arm", "group", {"accuracy": EPISODE_METRICS["accuracy"]})["none"]["all"]
    return {"steps": steps, "episodes": success}


def run(
    model: str | mmkv.ModelHandle = "small-qwen3-vl",
    n: int = 50,
    seed: int = 0,
    screenshot_in: str = "tool",
    window: int = 3,
    device: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Score ``n`` held-out episodes; write ``results.json`` / ``.md`` / ``.png`` to ``out``; return them."""
    handle = model if isinstance(model, mmkv.ModelHandle) else mmkv.load(model, device=device)
    name = handle.name if isinstance(model, mmkv.ModelHandle) else str(model)
    out = Path(out) if out is not None else default_out("episodes", name)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    records = []
    for episode in tqdm(
        heldout_episodes(n, seed), desc=f"episodes {name}", unit="episode", disable=not progress
    ):
        records.extend(score_episode(handle, episode, screenshot_in, window))
    table = aggregate(records, seed=seed)
    results = {
        "settings": {
            "model": name, "family": handle.family.name, "n": n, "seed": seed, "screenshot_in": screenshot_in,
            "window": window, "num_samples": len(records), "seconds": time.perf_counter() - started,
        },
        "records": records,
        "aggregate": table,
    }  # fmt: skip
    header = (
        f"# Episode eval: {name}\n\n{n} held-out episodes ({len(records)} steps), full recompute, screenshots in "
        f"{screenshot_in} messages, window {window}; Wilson 95% intervals in brackets.\n\n"
    )
    write_results(out, results, header, episode_markdown(table), None)
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--n", type=int, default=50, help="held-out episodes")
    parser.add_argument("--seed", type=int, default=0, help="first episode seed")
    parser.add_argument("--screenshot-in", choices=["tool", "user"], default="tool")
    parser.add_argument("--window", type=int, default=3, help="screenshots kept in the prompt")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="output folder (default runs/episodes-<model>)")
    return parser


if __name__ == "__main__":
    script_main("evals/episodes.py", build_parser(), run, episode_markdown)
