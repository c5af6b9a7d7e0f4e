"""What the evals share: bootstrap intervals, their formatting, and writing a run's JSON, Markdown and figure."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Estimate",
    "bootstrap",
    "cells",
    "default_out",
    "script_main",
    "format_interval",
    "save_figure",
    "write_results",
]


@dataclass(frozen=True)
class Estimate:
    """A statistic with its bootstrap interval."""

    value: float  # the statistic on all records
    low: float  # 2.5th percentile of the bootstrap distribution
    high: float  # 97.5th percentile


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
    interval. Seeded: the same inputs give the same interval. Raises ``ValueError`` on empty columns.

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


def format_interval(e: dict, digits: int = 2, scale: float = 1.0) -> str:
    """`value [low, high]` of an estimate dict, scaled and rounded."""
    v, lo, hi = (scale * e[k] for k in ("value", "low", "high"))
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def default_out(kind: str, model: str) -> Path:
    """``runs/<kind>-<model name>``, the name made safe for a path."""
    return Path("runs") / f"{kind}-{re.sub(r'[^A-Za-z0-9._-]+', '_', Path(model).name or model)}"


def write_results(
    out: Path, results: dict, header: str, markdown: str, figure: Callable[[Path], None]
) -> None:
    """Write ``results.json`` (``results``), ``results.md`` (``header`` + ``markdown``) and ``results.png``
    (drawn by ``figure(path)``) into ``out``."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(header + markdown + "\n")
    figure(out / "results.png")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'results.png'}")


def save_figure(fig, path: str | Path, title: str = "") -> None:
    """Title, lay out, save as a PNG and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cells(
    records: Sequence[dict],
    arm_key: str,
    group_key: str,
    metrics: dict[str, tuple[tuple[str, ...], Callable[..., np.ndarray]]],
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, dict]:
    """``{arm: {group: {"n", metric: {"value", "low", "high"}}}}`` over ``records``: arms and groups in order of
    first appearance, then ``"all"`` per arm; each metric is ``(columns, statistic)``, the statistic reducing the
    last axis of the paired columns (see ``bootstrap``). Pure.

    >>> rows = [{"arm": "a", "g": 1, "ok": 1.0}, {"arm": "a", "g": 2, "ok": 0.0}]
    >>> cells(rows, "arm", "g", {"ok": (("ok",), lambda x: x.mean(-1))})["a"]["all"]["ok"]["value"]
    0.5
    """
    from dataclasses import asdict

    table: dict[str, dict] = {}
    groups = list(dict.fromkeys(r[group_key] for r in records))
    for arm in dict.fromkeys(r[arm_key] for r in records):
        table[arm] = {}
        for group in [*groups, "all"]:
            cell = [r for r in records if r[arm_key] == arm and group in (r[group_key], "all")]
            if not cell:
                continue
            entry: dict = {"n": len(cell)}
            for name, (keys, statistic) in metrics.items():
                columns = [np.array([float(r[k]) for r in cell], dtype=np.float64) for k in keys]  # (n,) each
                entry[name] = asdict(bootstrap(columns, statistic, resamples, seed))
            table[arm][group] = entry
    return table


def script_main(prog: str, parser, run: Callable[..., dict], to_markdown: Callable[[dict], str]) -> None:
    """An eval's command line: a ``mmkv.MmkvError`` ends it with one line (exit 2); ``run(**args)``; the
    aggregate printed as Markdown, then how many samples took how long."""
    from mmkv.cli import install_error_hook

    install_error_hook(prog)
    results = run(**vars(parser.parse_args()))
    print(to_markdown(results["aggregate"]))
    print(f"\n{results['settings']['num_samples']} samples in {results['settings']['seconds']:.1f} s")
