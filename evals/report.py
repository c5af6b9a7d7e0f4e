"""What the evals share, in one place: intervals, per-cell aggregation, Markdown tables, figures, result files.

Intervals are honest about small and extreme counts: a proportion (accuracy, agreement, success: a 0/1 column)
gets the exact-coverage **Wilson** score interval, so a cell with no disagreement at n = 200 reads
``1.00 [0.98, 1.00]``, not ``[1.00, 1.00]``; a continuous statistic (logit cosine, TTFT, speedup, the
fraction reused) gets a seeded percentile **bootstrap** over the cell's records. Each eval declares its metrics
(``VQA_METRICS``, ``EDIT_METRICS``, ``COMPOSE_METRICS``, ``EPISODE_METRICS``) and aggregates with ``cells``;
its tables and figures are drawn here too (``*_markdown``, ``*_plot``). Scoring a sample stays in the eval.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "COMPOSE_METRICS", "EDIT_METRICS", "EPISODE_METRICS", "VQA_METRICS", "Estimate", "Metric", "bootstrap",
    "cells", "compose_markdown", "compose_plot", "default_out", "edit_markdown", "edit_plot", "episode_markdown",
    "format_interval", "save_figure", "script_main", "vqa_markdown", "vqa_plot", "wilson", "write_results",
]  # fmt: skip

Z95 = 1.959963984540054  # two-sided 95% normal quantile


@dataclass(frozen=True)
class Estimate:
    """A statistic with its interval."""

    value: float  # the statistic on all records
    low: float  # lower end of the 95% interval
    high: float  # upper end


def wilson(successes: int, n: int, z: float = Z95) -> Estimate:
    """The proportion ``successes / n`` with its Wilson score interval (95% for the default ``z``).

    >>> e = wilson(200, 200); (e.value, round(e.low, 4), e.high)
    (1.0, 0.9812, 1.0)
    """
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson needs 0 <= successes <= n and n > 0, got {successes} of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return Estimate(p, low, high)


def bootstrap(
    columns: Sequence[np.ndarray],
    statistic: Callable[..., np.ndarray],
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Estimate:
    """``statistic`` of the paired ``columns`` (equal-length 1-D arrays) with a percentile bootstrap interval.

    ``statistic`` reduces the last axis: it gets the columns as given for the point value and as ``(resamples,
    n)`` arrays of the same rows resampled with replacement (one row index set for all columns) for the
    interval. Seeded. Raises ``ValueError`` on empty or unequal columns.

    >>> bootstrap([np.array([1.0, 0.0, 1.0, 1.0])], lambda x: x.mean(-1)).value
    0.75
    """
    n = len(columns[0])
    if n == 0 or any(len(c) != n for c in columns):
        raise ValueError(
            f"bootstrap needs equal-length non-empty columns, got lengths {[len(c) for c in columns]}"
        )
    value = float(statistic(*columns))
    rows = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # (R, n)
    stats = statistic(*(np.asarray(c)[rows] for c in columns))  # (R,)
    low, high = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return Estimate(value, float(low), float(high))


@dataclass(frozen=True)
class Metric:
    """How one cell statistic is computed from the records' columns."""

    keys: tuple[str, ...]  # record fields read (paired, in this order)
    statistic: Callable[..., np.ndarray] | None = None  # None: a proportion of the one 0/1 field (Wilson)
    scale: float = 1.0  # applied to every value (1e3: seconds -> ms)

    def estimate(self, cell: Sequence[dict], resamples: int, seed: int) -> dict:
        """``{"value", "low", "high"}`` over ``cell``."""
        columns = [np.array([self.scale * float(r[k]) for r in cell], dtype=np.float64) for k in self.keys]
        if self.statistic is None:
            return asdict(wilson(int(columns[0].astype(bool).sum()), len(cell)))
        return asdict(bootstrap(columns, self.statistic, resamples, seed))


def _mean(x: np.ndarray) -> np.ndarray:
    return x.mean(-1)


def _median(x: np.ndarray) -> np.ndarray:
    return np.median(x, -1)


def _paired_speedup(reference_ttft: np.ndarray, arm_ttft: np.ndarray) -> np.ndarray:
    return np.median(reference_ttft, -1) / np.median(arm_ttft, -1)


def _ratio_of_sums(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    return part.sum(-1) / whole.sum(-1)


def _share(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """``part.sum / whole.sum``, 0 where ``whole`` sums to 0 (a cell, or a resample, with nothing to share)."""
    total = whole.sum(-1)
    return np.divide(part.sum(-1), total, out=np.zeros_like(total, dtype=np.float64), where=total > 0)


VQA_METRICS = {
    "accuracy": Metric(("correct",)),
    "agreement": Metric(("agree",)),
    "cosine": Metric(("cosine",), _mean),
    "ttft_s": Metric(("ttft_s",), _median),
    "speedup": Metric(("none_ttft_s", "ttft_s"), _paired_speedup),
    "reused_fraction": Metric(("reused_tokens", "prompt_tokens"), _ratio_of_sums),  # of prompt tokens
    "image_recomputed": Metric(("image_recomputed", "image_tokens"), _share),  # of spliced images' tokens
    "repair_ms": Metric(("repair_s",), _median, 1e3),  # choosing the repair's tokens (its pass included)
}
EDIT_METRICS = {
    "accuracy": Metric(("correct",)),
    "agreement": Metric(("agree",)),
    "follows_old": Metric(("follows_old",)),
    "cosine": Metric(("cosine",), _mean),
    "fraction": Metric(("fraction",), _median),
    "edit_ms": Metric(("edit_s",), _median, 1e3),
}
COMPOSE_METRICS = {
    "agreement": Metric(("agree",)),
    "accuracy": Metric(("correct",)),
    "cosine": Metric(("cosine",), _mean),
    "fraction": Metric(("fraction",), _median),
    "ttft_s": Metric(("ttft_s",), _median),
    "speedup": Metric(("full_ttft_s", "ttft_s"), _paired_speedup),
    "segment_recomputed": Metric(("segment_recomputed", "segment_tokens"), _share),  # of the spliced segment
    "repair_ms": Metric(("repair_s",), _median, 1e3),
}
EPISODE_METRICS = {
    "accuracy": Metric(("correct",)),
    "agreement": Metric(("agree",)),  # the same call as the reference arm (none) at the same step
    "prompt_tokens": Metric(("prompt_tokens",), _median),
    "images": Metric(("images",), _mean),
}


def cells(
    records: Sequence[dict],
    arm_key: str,
    group_key: str,
    metrics: dict[str, Metric],
    resamples: int = 1000,
    seed: int = 0,
    arm_order: Sequence[str] = (),
    extras: dict[str, Callable[[list[dict]], object]] | None = None,
) -> dict[str, dict]:
    """``{arm: {group: {"n", metric: {"value", "low", "high"}, extra: ...}}}`` over ``records``. Arms in
    ``arm_order``, then the others by first appearance; groups by first appearance, then ``"all"``. ``extras``
    maps a name to a function of the cell's records (e.g. the least shift). Pure.

    >>> rows = [{"arm": "a", "g": 1, "ok": 1}, {"arm": "a", "g": 2, "ok": 0}]
    >>> cells(rows, "arm", "g", {"ok": Metric(("ok",))})["a"]["all"]["ok"]["value"]
    0.5
    """
    present = list(dict.fromkeys(r[arm_key] for r in records))
    arms = [a for a in arm_order if a in present] + [a for a in present if a not in arm_order]
    groups = list(dict.fromkeys(r[group_key] for r in records))
    table: dict[str, dict] = {}
    for arm in arms:
        table[arm] = {}
        for group in [*groups, "all"]:
            cell = [r for r in records if r[arm_key] == arm and group in (r[group_key], "all")]
            if not cell:
                continue
            entry: dict = {"n": len(cell)}
            entry |= {name: metric.estimate(cell, resamples, seed) for name, metric in metrics.items()}
            entry |= {name: extra(cell) for name, extra in (extras or {}).items()}
            table[arm][group] = entry
    return table


# ------------------------------------------------------------------------------------------------- tables
def format_interval(e: dict, digits: int = 2, scale: float = 1.0) -> str:
    """`value [low, high]` of an estimate dict, scaled and rounded."""
    v, lo, hi = (scale * e[k] for k in ("value", "low", "high"))
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


Column = tuple[str, Callable[[dict], str]]  # header, cell -> text


def _column(header: str, key: str, digits: int = 2, scale: float = 1.0, suffix: str = "") -> Column:
    return header, lambda c: "" if c[key] is None else format_interval(c[key], digits, scale) + suffix


def _optional(
    table: dict[str, dict], *columns: Column, keys: Sequence[str] = ("image_recomputed", "repair_ms")
) -> list[Column]:
    """``columns`` when every cell of ``table`` has ``keys`` (results written before those metrics existed lack
    them), else none."""
    present = all(key in cell for groups in table.values() for cell in groups.values() for key in keys)
    return list(columns) if present else []


def _markdown(table: dict[str, dict], first: str, group: str, columns: Sequence[Column]) -> str:
    lines = [
        "| " + " | ".join([first, group, "n", *(h for h, _ in columns)]) + " |",
        "|" + "---|" * (3 + len(columns)),
    ]
    for arm, groups in table.items():
        for name, c in groups.items():
            label = f"{name} (at chance)" if c.get("at_chance") else str(name)  # evals/baselines.py
            row = [str(arm), label, str(c["n"]), *(f(c) for _, f in columns)]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def vqa_markdown(table: dict[str, dict]) -> str:
    """The VQA aggregate, one row per arm and category (marked ``(at chance)`` where none's accuracy cannot be
    told from the blind guesser's, ``chance``; ``acc - none acc``: the paired accuracy difference); ``reused`` is
    the fraction of prompt tokens not run through the model (spliced), ``img recomputed`` the share of spliced
    images' tokens computed in context (seam and repair), ``repair ms`` the median time of choosing them,
    ``shift`` the range of distances between where spliced images were cached and placed."""
    columns = [
        _column("accuracy", "accuracy"),
        *_optional(table, _column("acc - none acc", "delta_accuracy"), _column("none acc", "reference_accuracy"),
                   ("chance", lambda c: "" if c["chance"] is None else f"{c['chance']:.2f}"),
                   keys=("delta_accuracy", "reference_accuracy", "chance")),
        _column("agreement with none", "agreement"), _column("logit cosine", "cosine", 5),
        _column("median TTFT ms", "ttft_s", 1, 1e3),
        _column("speedup", "speedup", suffix="x"), _column("reused", "reused_fraction"),
        *_optional(table, _column("img recomputed", "image_recomputed", 3), _column("repair ms", "repair_ms", 1)),
        ("shift", lambda c: "" if c["min_abs_shift"] is None else f"{c['min_abs_shift']}-{c['max_abs_shift']}"),
    ]  # fmt: skip
    return _markdown(table, "arm", "category", columns)


def edit_markdown(table: dict[str, dict]) -> str:
    """The edit aggregate, one row per strategy and gate."""
    columns = [
        _column("accuracy", "accuracy"), _column("agreement with full", "agreement"),
        _column("follows old value", "follows_old"), _column("logit cosine", "cosine", 4),
        _column("fraction recomputed", "fraction", 3), _column("median edit ms", "edit_ms", 1),
    ]  # fmt: skip
    return _markdown(table, "strategy", "gate", columns)


def compose_markdown(table: dict[str, dict], by: str = "gate") -> str:
    """The compose aggregate, one row per arm and value of ``by``."""
    columns = [
        _column("agreement with full", "agreement"), _column("accuracy", "accuracy"),
        _column("logit cosine", "cosine", 4), _column("fraction computed", "fraction", 3),
        _column("median TTFT ms", "ttft_s", 1, 1e3), _column("speedup", "speedup", suffix="x"),
        *_optional(table, _column("segment recomputed", "segment_recomputed", 3),
                   _column("repair ms", "repair_ms", 1), keys=("segment_recomputed", "repair_ms")),
    ]  # fmt: skip
    return _markdown(table, "arm", by, columns)


def episode_markdown(table: dict) -> str:
    """The episode eval: per arm, per-step accuracy and agreement with none by decision kind, then episode
    success."""
    columns = [_column("step accuracy", "accuracy"), _column("agreement with none", "agreement"),
               _column("median prompt tokens", "prompt_tokens", 0), _column("images per prompt", "images", 1)]  # fmt: skip
    steps = _markdown(table["steps"], "arm", "decision", columns)
    episodes = _markdown(
        {arm: {"all": cell} for arm, cell in table["episodes"].items()}, "arm", "episodes",
        [_column("success", "accuracy")],
    )  # fmt: skip
    return steps + "\n\n" + episodes


# ------------------------------------------------------------------------------------------------ figures
def save_figure(fig, path: str | Path, title: str = "") -> None:
    """Title, lay out, save as a PNG and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _errors(estimates: Sequence[dict]) -> np.ndarray:
    """``(2, k)`` non-negative error-bar lengths below and above each value."""
    low = [e["value"] - e["low"] for e in estimates]
    high = [e["high"] - e["value"] for e in estimates]
    return np.clip(np.array([low, high]), 0, None)


def vqa_plot(table: dict[str, dict], path: str | Path, title: str = "") -> None:
    """Two panels over the arms (category ``"all"``): agreement with none and speedup over none, as bars with
    their intervals. Writes a PNG to ``path``."""
    plt = _pyplot()
    arms = [a for a in table if "all" in table[a]]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(arms)), 4.0))
    for ax, key, label in zip(
        axes, ("agreement", "speedup"), ("agreement with none", "speedup over none (x)"), strict=True
    ):
        est = [table[a]["all"][key] for a in arms]
        ax.bar(range(len(arms)), [e["value"] for e in est], yerr=_errors(est), capsize=4, color="tab:blue")
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        ax.set_ylabel(label)
        if key == "speedup":
            ax.axhline(1.0, color="grey", linewidth=0.8)
        else:
            ax.set_ylim(0, 1.05)
    save_figure(fig, path, title)


def edit_plot(table: dict[str, dict], path: str | Path, title: str = "") -> None:
    """Agreement with ``full`` (bars, per gate) and the fraction recomputed (bars), per strategy; a PNG."""
    plt = _pyplot()
    arms = list(table)
    gates = [g for g in next(iter(table.values())) if g != "all"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9.0, 1.5 * len(arms)), 4.0))
    width = 0.8 / max(1, len(gates))
    for i, gate in enumerate(gates):
        est = [table[a][gate]["agreement"] for a in arms]
        left.bar(np.arange(len(arms)) + i * width, [e["value"] for e in est], width, yerr=_errors(est), capsize=3,
                 label=f"{gate} gate")  # fmt: skip
    left.set_xticks(np.arange(len(arms)) + width * (len(gates) - 1) / 2, arms, rotation=30, ha="right")
    left.set_ylabel("decision agreement with full")
    left.set_ylim(0, 1.05)
    left.legend()
    right.bar(range(len(arms)), [table[a]["all"]["fraction"]["value"] for a in arms], color="tab:gray")
    right.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
    right.set_ylabel("fraction of context recomputed")
    save_figure(fig, path, title)


def compose_plot(by_shift: dict[str, dict], path: str | Path, title: str = "") -> None:
    """Agreement with ``full`` (left) and logit cosine (right) against the shift, one line per arm; a PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.2))
    for arm, groups in by_shift.items():
        if arm == "full":
            continue
        shifts = sorted(g for g in groups if g != "all")
        for ax, key in zip(axes, ("agreement", "cosine"), strict=True):
            style = "--" if arm.startswith("no-rotate") else "-"
            ax.plot(shifts, [groups[s][key]["value"] for s in shifts], style, marker="o", label=arm)
    axes[0].set_ylabel("decision agreement with full")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("first-token logit cosine with full")
    for ax in axes:
        ax.set_xscale("symlog", linthresh=50)
        ax.set_xlabel("positions moved (> 0: spliced after a preamble, < 0: compiled after one)")
    axes[1].legend(fontsize=7)
    save_figure(fig, path, title)


# ---------------------------------------------------------------------------------------------- result files
def default_out(kind: str, model: str) -> Path:
    """``runs/<kind>-<model name>``, the name made safe for a path."""
    return Path("runs") / f"{kind}-{re.sub(r'[^A-Za-z0-9._-]+', '_', Path(model).name or model)}"


def write_results(
    out: Path, results: dict, header: str, markdown: str, figure: Callable[[Path], None] | None
) -> None:
    """Write ``results.json`` (``results``), ``results.md`` (``header`` + ``markdown``) and, when ``figure`` is
    given, ``results.png`` (drawn by ``figure(path)``) into ``out``."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(header + markdown + "\n")
    written = [out / "results.json", out / "results.md"]
    if figure is not None:
        figure(out / "results.png")
        written.append(out / "results.png")
    print("wrote " + ", ".join(map(str, written)))


def script_main(prog: str, parser, run: Callable[..., dict], to_markdown: Callable[[dict], str]) -> None:
    """An eval's command line: a ``mmkv.MmkvError`` ends it with one line (exit 2); ``run(**args)``; the
    aggregate printed as Markdown, then how many samples took how long."""
    from mmkv.cli import install_error_hook

    install_error_hook(prog)
    results = run(**vars(parser.parse_args()))
    print(to_markdown(results["aggregate"]))
    print(f"\n{results['settings']['num_samples']} samples in {results['settings']['seconds']:.1f} s")
