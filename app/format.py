"""What the demo's page shows, as text and figures: one turn's line (``format_turn``), the turn log
(``format_turn_log``), the agent episode's step table, status and policy (``format_episode_log``,
``format_episode_status``, ``format_episode_policy``) and its TTFT chart (``episode_ttft_points``,
``episode_ttft_figure``), the stores' counters (``format_stats``) and the chat's TTFT plot (``ttft_figure``).
Pure functions of ``app.backend``'s and ``app.episode``'s records; no KV work here."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import NamedTuple

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mmkv import ImageReuse
from mmkv.cache import TierStats
from mmkv.envs import POLICY as POLICY_TEMPLATE
from mmkv.policy import REUSE_POLICIES

from .backend import COLD_LABEL, DemoBackend, TurnRecord
from .episode import AgentStep, EpisodeRun

__all__ = [
    "EPISODE_COLUMNS", "TtftPoint", "display_text", "episode_over_message", "episode_ttft_figure",
    "episode_ttft_points", "format_episode_log", "format_episode_policy", "format_episode_status", "format_stats",
    "format_turn", "format_turn_log", "images_summary", "ttft_figure",
]  # fmt: skip


def display_text(text: str) -> str:
    """``text`` with control characters (random-weight models emit them) shown as U+FFFD; ``(empty answer)``
    when nothing is left."""
    shown = "".join(
        "\ufffd" if unicodedata.category(ch) in ("Cc", "Cs") and ch not in "\n\t" else ch for ch in text
    )
    return shown.strip() or "(empty answer)"


def _image_phrase(image: ImageReuse) -> str:
    """Where one image's KV (and, when it was prefilled, its vision outputs) came from."""
    if image.source == "live":
        return "kept (live prefix)"
    if image.source != "computed":
        return f"cache hit ({image.source})"
    if image.encoder in ("memory", "disk", "redis"):
        return f"prefilled from cached vision outputs ({image.encoder})"
    return "computed"


def images_summary(images: Sequence[ImageReuse]) -> str:
    """``"3 images: 2 kept (live prefix), 1 cache hit (memory)"``: how many came from where, in a fixed order."""
    if not images:
        return "no images"
    phrases = [_image_phrase(r) for r in images]
    counts = {p: phrases.count(p) for p in dict.fromkeys(sorted(phrases, key=_phrase_order))}
    parts = ", ".join(f"{n} {p}" for p, n in counts.items())
    return f"{len(images)} image{'s' if len(images) > 1 else ''}: {parts}"


def _phrase_order(phrase: str) -> int:
    return ["kept", "cache", "prefilled", "computed"].index(phrase.split(" ")[0])


def format_turn(record: TurnRecord) -> str:
    """One line: where the prompt's images came from (counted), the TTFT with reuse and, when measured, without;
    e.g. ``turn 3 [kv]: 2 images: 1 kept (live prefix), 1 cache hit (memory) · TTFT 12.3 ms (kv) vs 45.6 ms
    (none, cold) = 3.7x · 162 of 232 prompt tokens reused``."""
    answer = record.answer
    images = [images_summary(answer.images)]
    hidden = record.num_images - len(answer.images)
    if hidden:
        images.append(f"{hidden} earlier image{'s' if hidden > 1 else ''} outside the window")
    ttft = f"TTFT {record.ttft_ms:.1f} ms ({record.reuse})"
    if record.cold_ttft_ms is not None:
        ttft += f" vs {record.cold_ttft_ms:.1f} ms (none, cold) = {record.cold_ttft_ms / record.ttft_ms:.1f}x"
    tokens = f"{answer.reused_tokens} of {answer.prompt_tokens} prompt tokens reused"
    return f"turn {record.number} [{record.reuse}]: {'; '.join(images)} · {ttft} · {tokens}"


def format_turn_log(turns: Sequence[TurnRecord]) -> str:
    """Markdown: the latest turn's line in bold, then the earlier turns, newest first."""
    if not turns:
        return (
            "*No turns yet: attach a screenshot and ask about it, or click the example steps below in order.*"
        )
    latest, *earlier = [format_turn(record) for record in reversed(turns)]
    return "\n".join([f"**{latest}**", "", *(f"- {line}" for line in earlier)])


# Short headers (the table is wide): the tool result and the images' sources get the room.
EPISODE_COLUMNS = ("step", "call", "right", "expected", "tool result", "reuse", "TTFT ms", "none ms",
                   "images: KV from", "tokens reused")  # fmt: skip


def _reuse_cell(step: AgentStep) -> str:
    """The step's policy; on the first step under a changed one, what it was and that the live cache restarted."""
    if step.reuse_was is None:
        return step.reuse
    return f"**{step.reuse}** (was {step.reuse_was}; from this step, new live cache)"


def _episode_row(step: AgentStep) -> str:
    answer = step.answer
    cells = (
        str(step.number), f"`{step.call}`" if step.call else "(no call)", "✓" if step.is_right else "✗",
        f"`{step.expected}`", _table_text(step.result), _reuse_cell(step), f"{step.ttft_ms:.1f}",
        f"{step.no_reuse_ms:.1f}", images_summary(answer.images), f"{answer.reused_tokens} of {answer.prompt_tokens}",
    )  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _table_text(text: str) -> str:
    """``text`` safe in a Markdown table cell (pipes escaped, one line)."""
    return display_text(text).replace("|", "\\|").replace("\n", " ")


def format_episode_log(steps: Sequence[AgentStep]) -> str:
    """Markdown: one row per step (``EPISODE_COLUMNS``): the call, ✓ or ✗, the right call, the tool result's text,
    the reuse policy (marked where it changed), TTFT, what the same prompt took without reuse (the ``none``
    twin's prefill), where each image's KV came from (counted, as ``images_summary``) and the prompt tokens not
    recomputed."""
    if not steps:
        return "*No steps yet: start an episode, then step through it or run it.*"
    lines = ["| " + " | ".join(EPISODE_COLUMNS) + " |", "|" + "---|" * len(EPISODE_COLUMNS)]
    return "\n".join(lines + [_episode_row(step) for step in steps])


def format_episode_status(run: EpisodeRun) -> str:
    """One Markdown line: the episode, the role in force, the steps made and right, and its state; a reuse policy
    asked for and not applied yet is named (it applies at the next step)."""
    if not run.started:
        return "*No episode yet.*"
    right = sum(step.is_right for step in run.steps)
    if not run.done:
        state = "running"
    elif run.stopped:
        state = "**stopped**: the last answer made no call"
    else:
        state = "**done: success**" if run.app.success else "**done: failed**"
    reuse = run.settings.reuse
    if run.pending_reuse is not None:
        reuse += f" → **{run.pending_reuse} from the next step**"
    return (
        f"Episode seed {run.seed} ({run.settings.split}, window {run.settings.window}, reuse "
        f"{reuse}) · account_role now: {run.app.role} · {len(run.steps)} steps, {right} right · {state}"
    )


def episode_over_message(run: EpisodeRun) -> str:
    """What a Step after the end says: the episode is over, how it ended, and what to press."""
    if run.stopped:
        how = "stopped: the last answer made no call"
    else:
        how = "succeeded" if run.app.success else "failed"
    return (
        f"Episode {run.seed} has ended ({how}, {len(run.steps)} steps): press New episode, or Run episode to "
        "start it again."
    )


def format_episode_policy(run: EpisodeRun) -> str:
    """Markdown: the policy as it applies now, with the account_role in force; once a dialog's close signed the
    agent in again under another role, that step and the role the system message still states are named."""
    if not run.started:
        return ""
    role = run.app.role
    text = POLICY_TEMPLATE.format(role=role)
    if role == run.start_role:
        return f"**Policy** (system message), account_role **{role}**: {text}"
    changed = next((step.number for step in run.steps if step.role == role), None)
    since = f" at step {changed}" if changed is not None else ""
    return (
        f"**Policy now**: account_role **{role}** (signed in again{since}, as its tool result says; the system "
        f"message still states {run.start_role}): {text}"
    )


class TtftPoint(NamedTuple):
    """One step of the episode's TTFT chart."""

    step: int  # the step's number
    reuse: str  # the policy the step was answered with
    reuse_ms: float  # its time to first token under that policy
    none_ms: float  # the same prompt's prefill without reuse (the reuse="none" twin)


def episode_ttft_points(steps: Sequence[AgentStep]) -> list[TtftPoint]:
    """The chart's data: one point per step, with reuse and without."""
    return [TtftPoint(step.number, step.reuse, step.ttft_ms, step.no_reuse_ms) for step in steps]


def episode_ttft_figure(steps: Sequence[AgentStep]) -> Figure:
    """Per step two bars: the TTFT under the step's policy (named under the step's number) and the same prompt
    without reuse (``none``: the twin with its own live prefix, no stores). A figure without bars before the
    first step."""
    points = episode_ttft_points(steps)
    figure = Figure(figsize=(6.0, 3.0), layout="constrained")
    axes = figure.add_subplot()
    width = 0.4
    if points:
        numbers = [p.step for p in points]
        axes.bar([n - width / 2 for n in numbers], [p.reuse_ms for p in points], width, label="with reuse")
        axes.bar([n + width / 2 for n in numbers], [p.none_ms for p in points], width, color="grey",
                 label="none (no reuse, same prompt)")  # fmt: skip
        axes.set_xticks(numbers, [f"{p.step}\n{p.reuse}" for p in points])
        tallest = max(max(p.reuse_ms, p.none_ms) for p in points) or 1.0
        axes.set_ylim(0, 1.3 * tallest)  # room for the legend above the bars
        axes.legend(loc="upper left", fontsize="small", ncols=2)
    else:
        axes.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=axes.transAxes)
        axes.set_xticks([])
    axes.set_title("Time to first token per step")
    axes.set_xlabel("step (policy)")
    axes.set_ylabel("TTFT (ms)")
    axes.set_ylim(bottom=0)
    return figure


def _human_bytes(num: int) -> str:
    """``num`` bytes in decimal units: ``0 B``, ``43.0 kB``, ``1.2 MB``, ``3.4 GB``."""
    if num < 1000:
        return f"{num} B"
    value, unit = num / 1000, "kB"
    for larger in ("MB", "GB"):
        if value < 1000:
            break
        value, unit = value / 1000, larger
    return f"{value:.1f} {unit}"


STATS_ROWS = ("hits", "misses", "entries", "bytes", "evictions", "corrupt", "write errors")


def _stats_cells(stats: TierStats) -> tuple[str, ...]:
    """``stats`` in the order of ``STATS_ROWS``."""
    counts = (stats.hits, stats.misses, stats.entries, _human_bytes(stats.bytes), stats.evictions)
    return tuple(str(value) for value in (*counts, stats.corrupt, stats.write_errors))


def format_stats(backend: DemoBackend) -> str:
    """A Markdown table of both stores' counters (shared by all browser sessions): one row per counter in
    ``STATS_ROWS``, one column per store and tier: ``KV · memory``, ``KV · disk`` (the ``KVStore``),
    ``encoder · memory``, ``encoder · disk`` (the ``EncoderStore``); disk columns only with a store directory."""
    with backend.lock:
        stores = [("KV", backend.kv_store.stats()), ("encoder", backend.encoder_store.stats())]
    columns = []  # (header, cells)
    for name, stats in stores:
        columns.append((f"{name} · memory", _stats_cells(stats.memory)))
        if stats.disk is not None:
            columns.append((f"{name} · disk", _stats_cells(stats.disk)))
    lines = ["| counter | " + " | ".join(header for header, _ in columns) + " |"]
    lines.append("|---|" + "---:|" * len(columns))
    for row, counter in enumerate(STATS_ROWS):
        lines.append(f"| {counter} | " + " | ".join(cells[row] for _, cells in columns) + " |")
    lines += ["", "KV: the images' language-model KV · encoder: their vision-tower outputs."]
    if backend.store_dir is None:
        lines += ["", "No disk tier: start the demo with `--store DIR` to keep entries across restarts."]
    return "\n".join(lines)


def ttft_figure(turns: Sequence[TurnRecord]) -> Figure:
    """TTFT (ms) per turn: one line per reuse policy the turns were answered with, and one for the cold full
    recompute where it was measured (``COLD_LABEL``). A figure without lines when there are no turns."""
    figure = Figure(figsize=(6.0, 3.4), layout="constrained")
    axes = figure.add_subplot()
    for policy in REUSE_POLICIES:
        points = [(record.number, record.ttft_ms) for record in turns if record.reuse == policy]
        if points:
            axes.plot([n for n, _ in points], [ms for _, ms in points], marker="o", label=f"reuse {policy}")
    cold = [(record.number, record.cold_ttft_ms) for record in turns if record.cold_ttft_ms is not None]
    if cold:
        axes.plot(
            [n for n, _ in cold],
            [ms for _, ms in cold],
            marker="s",
            linestyle="--",
            color="grey",
            label=COLD_LABEL,
        )
    axes.set_title("Time to first token per turn")
    axes.set_xlabel("turn")
    axes.set_ylabel("TTFT (ms)")
    last_turn = max((record.number for record in turns), default=1)
    if last_turn <= 20:
        axes.set_xticks(range(1, last_turn + 1))  # one tick per turn (a single turn is not 0.5 to 1.5 by 0.1)
    else:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlim(0.5, max((record.number for record in turns), default=1) + 0.5)
    axes.set_ylim(bottom=0)
    if axes.lines:
        axes.legend(loc="best")
    else:
        axes.text(0.5, 0.5, "no turns yet", ha="center", va="center", transform=axes.transAxes)
    return figure
