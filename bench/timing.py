"""Timing that survives a noisy machine: arms interleaved in one process (A B C A B C ...), medians with min-max.

A benchmark that runs one arm after another measures the machine's mood as much as the arms: a neighbour that
wakes up during arm B makes B look slow. ``interleave`` runs one repeat of every arm per round, in a rotating
order, after one untimed warm-up round, and reports each arm's median with its min and max. Example::

    from bench.timing import interleave
    result = interleave({"fused": lambda: f(x), "loop": lambda: g(x)}, repeats=5)
    print(result["fused"])        # 1.23 ms [1.20-1.31]
    ratio = result["loop"].median / result["fused"].median
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["Timing", "interleave", "sync"]


@dataclass(frozen=True)
class Timing:
    """The samples of one arm, in milliseconds."""

    samples: tuple[float, ...]  # one per round, in round order

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median(self) -> float:
        """Median of the samples (ms)."""
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        """Fastest sample (ms)."""
        return min(self.samples)

    @property
    def max(self) -> float:
        """Slowest sample (ms)."""
        return max(self.samples)

    def as_dict(self) -> dict[str, float]:
        """``{"median", "min", "max"}`` in ms, for JSON."""
        return {"median": self.median, "min": self.min, "max": self.max}

    def __str__(self) -> str:
        return f"{self.median:.2f} ms [{self.min:.2f}-{self.max:.2f}]"


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (a no-op on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleave(
    arms: Mapping[str, Callable[[], object]],
    repeats: int,
    device: torch.device | str | None = None,
    warmup: bool = True,
    measure: Callable[[str, Callable[[], object]], float] | None = None,
) -> dict[str, Timing]:
    """Run every arm once per round for ``repeats`` rounds (order rotated each round, so no arm always runs
    first) after one untimed warm-up round; returns each arm's ``Timing``.

    ``measure(name, fn) -> ms`` replaces the default wall-clock measurement (e.g. to read a time the arm
    reports itself, such as ``Answer.ttft_s``). Device work is synchronised around each default measurement.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(arms)

    def wall(name: str, fn: Callable[[], object]) -> float:
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        return 1e3 * (time.perf_counter() - started)

    measure = measure or wall
    if warmup:
        for name in names:
            measure(name, arms[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(measure(name, arms[name]))
    return {name: Timing(tuple(samples[name])) for name in names}
