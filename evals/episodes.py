"""The episode eval: does the model act right through tools on held-out desktop episodes, and does reuse change it?

Each held-out episode of ``mmkv.envs.DesktopApp`` (new seeds, pictures never shown in training) is replayed step
by step: the prompt is the message list an agent resends before that step (``Episode.messages``: the policy,
the task, the history of tool calls and results, the last ``--window`` screenshots in tool messages or in user
messages), the model answers greedily, and its first hermes tool call is compared with the right one. The
history is always the right one (each step is scored on its own), so per-step accuracy is what an agent
corrected at every step would get; an episode succeeds when every one of its steps is right.

Two arms, run side by side step by step:

- ``none``, the reference: full recompute through the stock path (``processor.apply_chat_template(messages,
  tools=...)``, the processor, the model's own forward at its own ``get_rope_index`` positions, greedy);
- ``kv``: the same messages sent, in the agent's order, to ``mmkv serve``'s app in process (the official
  ``openai`` client over an ASGI transport; ``tool_choice="auto"``, greedy): the pool continues each request
  from the previous one's cache, and once the window slid, the screenshots that moved are spliced from the store,
  re-rotated. Its ``agreement`` is the fraction of steps whose call equals ``none``'s.

Reported per arm and decision kind (approve, escalate, fill, submit, ok, close), for the steps that depend on an
earlier step (a returning ticket, a role signed in again), and overall: per-step accuracy, agreement with
``none``, episode success, with Wilson 95% intervals; the prompt's tokens and images per step, and for ``kv``
the fraction of prompt tokens not recomputed.

    python evals/episodes.py --model small-qwen3-vl --n 50
    python evals/episodes.py --model small-qwen3-vl --n 50 --arms none         # the reference only
    python evals/episodes.py --model tiny-qwen3-vl --n 2 --screenshot-in user --window 2
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

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
from mmkv.compat import cache_argument_name  # noqa: E402
from mmkv.envs import Episode, FunctionCall, expert_episode, message_images, parse_tool_calls  # noqa: E402
from mmkv.model.processor import VLProcessor  # noqa: E402

__all__ = [
    "ARMS", "aggregate", "greedy_text", "heldout_episodes", "run", "score_episode", "served_client",
    "step_inputs",
]  # fmt: skip

ARMS = ("none", "kv")  # the reference (stock path, full recompute) and reuse through the server

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
    removed: the model's own forward, at the positions of its own ``get_rope_index``, over a fresh cache.
    Changes no state of the shared model (``generate`` would: it keeps ``rope_deltas`` on it)."""
    model = handle.model
    inputs = {k: v.to(handle.device) for k, v in inputs.items()}
    rope_index = model.model.get_rope_index  # pure: returns positions and deltas, stores nothing
    wanted = inspect.signature(rope_index).parameters
    positions, _ = rope_index(
        inputs["input_ids"], **{k: v for k, v in inputs.items() if k in wanted and k != "input_ids"}
    )  # (3, 1, L)
    cache = {cache_argument_name(model): DynamicCache(config=handle.text_config), "use_cache": True}
    step, following = dict(inputs, position_ids=positions), positions.max() + 1
    eos, tokens = handle.tokenizer.convert_tokens_to_ids("<|im_end|>"), []
    while len(tokens) < max_new_tokens:
        token = int(model(**step, **cache).logits[0, -1].argmax())
        if token == eos:
            break
        tokens.append(token)
        step = {
            "input_ids": torch.tensor([[token]], device=handle.device),
            "position_ids": following.expand(3, 1, 1),
        }
        following = following + 1
    return handle.tokenizer.decode(tokens, skip_special_tokens=True)


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
            "arm": "none", "seed": episode.seed, "step": k, "steps": len(episode.steps), "kind": step.kind,
            "uses_history": step.uses_history, "expected": str(step.call), "answer": answer,
            "called": str(calls[0]) if calls else "", "correct": bool(calls) and calls[0] == step.call,
            "agree": True, "prompt_tokens": int(inputs["input_ids"].shape[1]),
            "images": len(message_images(messages)),
        })  # fmt: skip
    return records


@contextmanager
def served_client(handle: mmkv.ModelHandle, name: str) -> Iterator:
    """An ``openai.OpenAI`` client over ``mmkv serve``'s app for ``handle`` in this process (ASGI transport, no
    socket; its own pool and in-memory stores, served under ``name``); closed on exit."""
    from openai import OpenAI
    from starlette.testclient import TestClient

    from mmkv.serve import Engine, ServerConfig, create_app

    engine = Engine(ServerConfig(model=name, device=str(handle.device)), handle)
    try:
        with TestClient(create_app(engine)) as http:
            yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    finally:
        engine.close()


def _first_call(message) -> FunctionCall | None:
    """The first call of a returned assistant message (tool_calls, else hermes blocks left in its text)."""
    for entry in message.tool_calls or ():
        try:
            return FunctionCall.from_openai({"function": {"name": entry.function.name,
                                                      "arguments": entry.function.arguments}})  # fmt: skip
        except (ValueError, json.JSONDecodeError):
            return FunctionCall(entry.function.name, {"invalid arguments": entry.function.arguments})
    calls = parse_tool_calls(message.content or "")
    return calls[0] if calls else None


def score_episode_served(
    client,
    model: str,
    episode: Episode,
    reference: Sequence[dict],
    screenshot_in: str = "tool",
    window: int | None = 3,
    reuse: str = "kv",
    max_new_tokens: int = MAX_CALL_TOKENS,
) -> list[dict]:
    """One record per step through the server (``client`` from ``served_client``) under ``reuse``: the prompt
    before each step sent as an agent resends it (greedy, ``tool_choice="auto"``), the first call scored and
    compared with ``reference`` (the ``none`` records of the same episode). Fields as ``score_episode``, and
    ``agree`` (the same call as the reference, or both none and the same text), ``reused_tokens``,
    ``ttft_ms`` (the server's), ``sources`` (per image in the prompt: live, memory, computed, ...)."""
    tools, records = episode.tools, []
    for k, (step, ref) in enumerate(zip(episode.steps, reference, strict=True)):
        messages = episode.messages(k, screenshot_in=screenshot_in, window=window)
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice="auto", max_tokens=max_new_tokens,
            temperature=0, extra_body={"mmkv": {"reuse": reuse}},
        )  # fmt: skip
        message, report = reply.choices[0].message, reply.model_extra["mmkv"]
        call = _first_call(message)
        called = str(call) if call is not None else ""
        records.append({
            "arm": reuse, "seed": episode.seed, "step": k, "steps": len(episode.steps), "kind": step.kind,
            "uses_history": step.uses_history, "expected": str(step.call), "answer": message.content or "",
            "called": called, "correct": call == step.call,
            "agree": called == ref["called"] and (called != "" or (message.content or "") == ref["answer"]),
            "prompt_tokens": reply.usage.prompt_tokens, "images": len(report["images"]),
            "reused_tokens": report["reused_tokens"], "ttft_ms": report["ttft_ms"],
            "sources": [i["source"] for i in report["images"]],
        })  # fmt: skip
    return records


def aggregate(records: Sequence[dict], resamples: int = 1000, seed: int = 0) -> dict:
    """``{"steps": {arm: {kind | "all" | "uses history": cell}}, "episodes": {arm: cell}}``: per-step cells
    (``accuracy`` and ``agreement`` with none, Wilson intervals; ``prompt_tokens`` median, ``images`` mean) by arm
    and decision kind, overall, and over the steps that depend on an earlier one; then per arm episode success
    (every step right) over episodes. A record without ``arm`` is ``none``'s. Pure."""
    rows = [{"arm": "none", "agree": True} | r for r in records]
    steps = cells(rows, "arm", "kind", EPISODE_METRICS, resamples, seed, arm_order=ARMS)
    history = [r | {"group": "uses history"} for r in rows if r["uses_history"]]
    for arm, table in cells(history, "arm", "group", EPISODE_METRICS, resamples, seed).items():
        steps[arm]["uses history"] = table["all"]
    by_episode: dict[tuple[str, int], bool] = {}
    for r in rows:
        key = (r["arm"], r["seed"])
        by_episode[key] = by_episode.get(key, True) and bool(r["correct"])
    episodes = [{"arm": arm, "group": "all", "correct": ok} for (arm, _), ok in by_episode.items()]
    success = cells(episodes, "arm", "group", {"accuracy": EPISODE_METRICS["accuracy"]}, arm_order=ARMS)
    return {"steps": steps, "episodes": {arm: table["all"] for arm, table in success.items()}}


def run(
    model: str | mmkv.ModelHandle = "small-qwen3-vl",
    n: int = 50,
    seed: int = 0,
    screenshot_in: str = "tool",
    window: int = 3,
    arms: Sequence[str] = ARMS,
    device: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Score ``n`` held-out episodes under ``arms`` (``none`` always runs: it is the reference); write
    ``results.json`` / ``.md`` to ``out``; return them."""
    handle = model if isinstance(model, mmkv.ModelHandle) else mmkv.load(model, device=device)
    name = handle.name if isinstance(model, mmkv.ModelHandle) else str(model)
    out = Path(out) if out is not None else default_out("episodes", name)
    out.mkdir(parents=True, exist_ok=True)
    served = [arm for arm in arms if arm != "none"]
    started = time.perf_counter()
    records = []
    with served_client(handle, name) if served else _nothing() as client:
        for episode in tqdm(
            heldout_episodes(n, seed), desc=f"episodes {name}", unit="episode", disable=not progress
        ):
            reference = score_episode(handle, episode, screenshot_in, window)
            records.extend(reference)
            for arm in served:
                records.extend(
                    score_episode_served(client, name, episode, reference, screenshot_in, window, arm)
                )
    table = aggregate(records, seed=seed)
    results = {
        "settings": {
            "model": name, "family": handle.family.name, "n": n, "seed": seed, "screenshot_in": screenshot_in,
            "window": window, "arms": ["none", *served], "num_samples": len(records),
            "seconds": time.perf_counter() - started,
        },
        "records": records,
        "aggregate": table,
    }  # fmt: skip
    header = (
        f"# Episode eval: {name}\n\n{n} held-out episodes ({len(records) // (1 + len(served))} steps), "
        f"screenshots in {screenshot_in} messages, window {window}. `none`: full recompute (stock path); "
        f"`kv`: through mmkv serve (pool prefix, screenshots spliced from the store); agreement: the same call "
        f"as `none`. Wilson 95% intervals in brackets.\n\n"
    )
    write_results(out, results, header, episode_markdown(table), None)
    return results


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--n", type=int, default=50, help="held-out episodes")
    parser.add_argument("--seed", type=int, default=0, help="first episode seed")
    parser.add_argument("--screenshot-in", choices=["tool", "user"], default="tool")
    parser.add_argument("--window", type=int, default=3, help="screenshots kept in the prompt")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="none always runs")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="output folder (default runs/episodes-<model>)")
    return parser


if __name__ == "__main__":
    script_main("evals/episodes.py", build_parser(), run, episode_markdown)
