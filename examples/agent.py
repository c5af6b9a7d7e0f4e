"""An agent acting on the simulated ticket desk through ``mmkv serve``, with the official ``openai`` client.

Each episode of ``mmkv.envs.DesktopApp`` is run as a computer-use agent runs: the policy as system message and
the first screenshot in the first user message; each turn the whole history is resent (only the last
``--window`` screenshots keep their image), the model answers with a tool call, the agent executes it on the
app, and the tool result carries the next screenshot (in the tool message, or with ``--screenshot-in user`` in a
user message after it). The assistant messages are resent exactly as the server returned them (ids, arguments
as written). Per step it prints the call, whether it was the right one, the server's time to first token and
where each image's KV came from (``live``: the pool's cache of the previous request; ``memory`` / ``disk``: the
store, spliced at its new position once the window slid; ``computed``).

Run::

    python examples/agent.py --serve --model small-qwen3-vl --episodes 3          # starts its own server
    mmkv serve --model small-qwen3-vl --port 8000 &
    python examples/agent.py --base-url http://127.0.0.1:8000/v1 --episodes 5 --window 3
    python examples/agent.py --serve --model tiny-qwen3-vl --episodes 1           # random weights: wrong calls

With ``--tool-choice required`` (the default) the server constrains every answer to a call of a listed tool
(``auto``: the model may answer with text, which ends the episode, as agent frameworks end a run on text).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmkv.envs import DesktopApp, FunctionCall, image_data_url, keep_last_screenshots, tool_result_messages  # noqa: E402
from mmkv.serve.process import ServerProcess  # noqa: E402

__all__ = ["EpisodeResult", "StepRecord", "main", "run", "run_episode", "summary"]

MAX_CALL_TOKENS = 96  # a call is about 22 tokens with the retrained tokenizer, ~70 with the tiny ones


@dataclass(frozen=True)
class StepRecord:
    """One request of an episode: the call the model made and what it cost."""

    seed: int  # the episode's seed
    step: int  # 0-based request number within the episode
    call: str  # the call made, ``click(target=ok)`` form ("" when the answer made none)
    expected: str  # the right call at this step
    is_right: bool  # the call was the right one
    kind: str  # the decision's kind (approve, escalate, fill, submit, ok, close)
    ttft_ms: float  # the server's time to first token (from the worker taking the request)
    queue_ms: float  # the server's queue wait before that
    client_ms: float  # the whole request, as the client saw it
    sources: tuple[str, ...]  # per image in the prompt, where its KV came from (live, memory, disk, computed)
    prompt_tokens: int  # tokens in the prompt
    cached_tokens: int  # of which not recomputed (pool prefix and spliced images)


@dataclass
class EpisodeResult:
    """One episode: its steps, whether it succeeded, and the history the agent last sent."""

    seed: int
    steps: list[StepRecord] = field(default_factory=list)
    success: bool = False  # the queue was emptied without a wrong call
    messages: list[dict] = field(default_factory=list)  # the full history (every screenshot kept)


def _call_text(call) -> tuple[str, dict]:
    """A returned tool call's name and arguments (``{}`` when its arguments are not a JSON object)."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return call.function.name, arguments if isinstance(arguments, dict) else {}


def run_episode(
    client: openai.OpenAI,
    model: str,
    seed: int,
    *,
    split: str = "heldout",
    window: int | None = 3,
    screenshot_in: str = "tool",
    tool_choice: str = "required",
    reuse: str | None = None,
    max_tokens: int = MAX_CALL_TOKENS,
    on_step: Callable[[StepRecord], None] | None = None,
) -> EpisodeResult:
    """Run the episode of ``(seed, split)`` to its end (queue empty, the app's step bound, or an answer without
    a call); ``reuse`` overrides the server's policy per request (``{"mmkv": {"reuse": ...}}``). Greedy."""
    app = DesktopApp(split)
    first = app.reset(seed)
    tools = app.tools()
    messages: list[dict] = [
        {"role": "system", "content": app.policy},
        {"role": "user", "content": [{"type": "text", "text": first.text},
                                     {"type": "image_url", "image_url": {"url": image_data_url(first.image)}}]},
    ]  # fmt: skip
    result = EpisodeResult(seed)
    extra = {"mmkv": {"reuse": reuse}} if reuse else None
    while not app.done:
        expected = app.expected_call()
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=keep_last_screenshots(messages, window), tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=False, max_tokens=max_tokens, temperature=0, extra_body=extra,
        )  # fmt: skip
        client_ms = 1e3 * (time.perf_counter() - started)
        message, report = reply.choices[0].message, reply.model_extra["mmkv"]
        calls = list(message.tool_calls or ())
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump(exclude_none=True) for c in calls] or None})  # fmt: skip
        outcome = None
        for call in calls:  # one, unless the server was asked for parallel calls
            name, arguments = _call_text(call)
            outcome = app.step(name, arguments)
            messages += tool_result_messages(call.id, outcome.text, outcome.image, screenshot_in)
            if app.done:
                break
        made = str(FunctionCall(*_call_text(calls[0]))) if calls else ""
        record = StepRecord(
            seed, len(result.steps), made, str(expected), outcome is not None and outcome.is_right,
            outcome.kind if outcome is not None else "", report["ttft_ms"], report["queue_ms"], client_ms,
            tuple(i["source"] for i in report["images"]), reply.usage.prompt_tokens,
            reply.usage.prompt_tokens_details.cached_tokens,
        )  # fmt: skip
        result.steps.append(record)
        if on_step is not None:
            on_step(record)
        if not calls:  # text instead of a call: the agent has nothing to do (a framework ends its run here)
            break
    if result.steps and not result.steps[-1].call:
        messages.pop()  # the text answer is not part of a history the agent would resend
    result.success, result.messages = app.success, messages
    return result


def print_step(record: StepRecord) -> None:
    """One line per step: the call, right or wrong (with the right one), TTFT and the images' sources."""
    verdict = "right" if record.is_right else f"WRONG (expected {record.expected})"
    print(
        f"  step {record.step + 1:2d}  {record.call or '(no call)':32s} {verdict:40s} "
        f"TTFT {record.ttft_ms:7.1f} ms  cached {record.cached_tokens:4d}/{record.prompt_tokens:4d}  "
        f"images: {' '.join(record.sources) or '-'}",
        flush=True,
    )


def summary(results: list[EpisodeResult]) -> dict:
    """Per-step accuracy, episode success, median TTFT and the images' sources over ``results``."""
    steps = [s for r in results for s in r.steps]
    ttft = sorted(s.ttft_ms for s in steps)
    sources = [src for s in steps for src in s.sources]
    return {
        "episodes": len(results), "steps": len(steps),
        "step_accuracy": sum(s.is_right for s in steps) / max(1, len(steps)),
        "episode_success": sum(r.success for r in results) / max(1, len(results)),
        "ttft_ms_median": ttft[len(ttft) // 2] if ttft else None,
        "sources": {k: sources.count(k) for k in sorted(set(sources))},
    }  # fmt: skip


def run(
    base_url: str | None = None,
    model: str | None = None,
    episodes: int = 3,
    seed: int = 0,
    window: int | None = 3,
    *,
    split: str = "heldout",
    screenshot_in: str = "tool",
    tool_choice: str = "required",
    reuse: str | None = None,
    device: str = "cpu",
    api_key: str = "unused",
    quiet: bool = False,
) -> list[EpisodeResult]:
    """Run ``episodes`` episodes (seeds ``seed``, ``seed + 1``, ...) against the server at ``base_url``, or,
    without one, against a ``mmkv serve --model model`` this call starts and stops."""
    with ExitStack() as stack:
        if base_url is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "server.log"
            server = stack.enter_context(
                ServerProcess(["--model", model or "small-qwen3-vl", "--device", device], log)
            )
            base_url = f"{server.base_url}/v1"
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
        model = model or client.models.list().data[0].id
        results = []
        for number in range(episodes):
            if not quiet:
                print(f"episode {number + 1}/{episodes} (seed {seed + number}, {split})", flush=True)
            result = run_episode(
                client, model, seed + number, split=split, window=window, screenshot_in=screenshot_in,
                tool_choice=tool_choice, reuse=reuse, on_step=None if quiet else print_step,
            )  # fmt: skip
            results.append(result)
            if not quiet:
                print(f"  -> {'success' if result.success else 'failed'}", flush=True)
    if not quiet:
        print(json.dumps(summary(results)))
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None, help="a running server's /v1 URL")
    where.add_argument("--serve", action="store_true", help="start a server for --model (the default)")
    parser.add_argument("--model", default=None, help="model to serve / ask (default: the server's first)")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="first episode's seed")
    parser.add_argument("--split", choices=["heldout", "train"], default="heldout")
    parser.add_argument("--window", type=int, default=3, help="screenshots kept in the resent history")
    parser.add_argument("--screenshot-in", choices=["tool", "user"], default="tool")
    parser.add_argument("--tool-choice", choices=["required", "auto"], default="required")
    parser.add_argument("--reuse", choices=["kv", "encoder", "none"], default=None, help="per-request policy")
    parser.add_argument("--device", default="cpu", help="the started server's device")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--json", default=None, help="write every step record here")
    return parser


def main(argv: list[str] | None = None) -> list[EpisodeResult]:
    args = build_parser().parse_args(argv)
    results = run(
        args.base_url, args.model, args.episodes, args.seed, args.window, split=args.split,
        screenshot_in=args.screenshot_in, tool_choice=args.tool_choice, reuse=args.reuse, device=args.device,
        api_key=args.api_key,
    )  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary(results), "steps": [
            asdict(s) for r in results for s in r.steps]}, indent=1))  # fmt: skip
    return results


if __name__ == "__main__":
    main()
