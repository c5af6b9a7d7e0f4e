"""``TurnPolicy``: how a turn reuses work, the one record of per-turn reuse settings (a ``SessionConfig`` and the
server's config embed it; a request's ``"mmkv"`` object overrides some of its fields).

Two groups of fields. Reuse: ``reuse`` (splice cached KV, reuse cached vision outputs, or neither) and, for
spliced KV, how it is placed (``rotate``, ``rotate_axes``). Repair: spliced KV keeps the attention it took in the
context it was computed in, so some of its tokens are recomputed in the new context: the first ``seam`` tokens of
every spliced segment, then ``budget`` of the rest, chosen by ``repair``:

- ``"seam"``: the leading ones (a longer seam);
- ``"deviation"``: those whose layer-1 keys and values move most when the first two layers are recomputed in
  the new context (CacheBlend's selection);
- ``"attention"``: those the prompt's last tokens attend to most, averaged over layers and heads.

The allowed values are declared here once (``ReusePolicy``, ``RepairKind``, ``Ranking`` and their tuples
``REUSE_POLICIES``, ``REPAIRS``, ``RANKINGS``, and the seam's bound ``MAX_SEAM``); the request model, the CLI,
the demo and the edit strategies take them from here. Code asks the policy (``splices_kv``, ``reads_stores``),
never compares ``reuse`` with a string.

Example: an image of 66 tokens (64 pads and two markers) spliced with ``seam=1, repair="deviation",
budget=0.05``: its ``<|vision_start|>`` is computed (the seam), ``ceil(0.05 * 65) = 4`` of its other 65 tokens
are computed (the four that deviate most), 61 are spliced: 5 of 66 tokens (7.6%) recomputed in context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "DEFAULT_BUDGET", "MAX_SEAM", "RANKINGS", "REPAIRS", "REUSE_POLICIES", "Ranking", "RepairKind", "ReusePolicy",
    "TurnPolicy",
]  # fmt: skip

ReusePolicy = Literal["kv", "encoder", "none"]  # splice cached KV / reuse cached vision outputs / neither
Ranking = Literal["deviation", "attention"]  # how tokens are ranked for recompute (repair and field edits)
RepairKind = Literal["seam", Ranking]  # "seam": the leading tokens, no ranking
REUSE_POLICIES: tuple[ReusePolicy, ...] = get_args(ReusePolicy)
RANKINGS: tuple[Ranking, ...] = get_args(Ranking)
REPAIRS: tuple[RepairKind, ...] = get_args(RepairKind)  # ("seam", "deviation", "attention")
MAX_SEAM = 4096  # the longest seam a policy takes (a request's or the CLI's alike)
DEFAULT_BUDGET = 0.05  # a ranking repair's budget when none is given (VLCache recomputes 2-5% of tokens)


@dataclass(frozen=True)
class TurnPolicy:
    """How a turn reuses work. Validated on construction; every combination of valid fields is valid."""

    reuse: ReusePolicy = "kv"  # "kv" (splice cached KV), "encoder" (cached vision outputs), "none"
    seam: int = 1  # kv: leading tokens of a spliced segment recomputed in context (0: pure splice)
    rotate: bool = True  # kv: re-rotate spliced keys (False only for the no-rotation control)
    rotate_axes: tuple[int, ...] = (0, 1, 2)  # kv: axes re-rotated; (0,) is the temporal-only ablation
    repair: RepairKind = "seam"  # kv: how the budget's tokens are chosen (see the module docstring)
    budget: float | None = (
        None  # kv: fraction of each segment's spliced tokens (after the seam) recomputed in
    )
    # context, rounded up; None: the repair's default (0 for "seam": bit-identical to a plain seam; else 0.05)

    def __post_init__(self) -> None:
        if self.reuse not in REUSE_POLICIES:
            raise ValueError(f"reuse must be one of {REUSE_POLICIES}, got {self.reuse!r}")
        if isinstance(self.seam, bool) or not isinstance(self.seam, int) or not 0 <= self.seam <= MAX_SEAM:
            raise ValueError(f"seam must be an int in [0, {MAX_SEAM}], got {self.seam!r}")
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate must be a bool, got {self.rotate!r}")
        if not set(self.rotate_axes) <= {0, 1, 2}:
            raise ValueError(f"rotate_axes must be a subset of (0, 1, 2), got {self.rotate_axes}")
        if self.repair not in REPAIRS:
            raise ValueError(f"repair must be one of {REPAIRS}, got {self.repair!r}")
        budget = self.budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1
        ):  # NaN fails the range check too
            raise ValueError(
                f"budget must be a fraction in [0, 1] (or None: the repair's default), got {budget!r}"
            )

    @property
    def splices_kv(self) -> bool:
        """Whether cached KV (stored images, precompiled text, text cut off the live cache) is spliced."""
        return self.reuse == "kv"

    @property
    def reads_stores(self) -> bool:
        """Whether the stores are read and written at all (``"none"``: every image through the vision tower)."""
        return self.reuse != "none"

    @property
    def repair_budget(self) -> float:
        """The budget in force: ``budget``, or the repair's default when it is None."""
        if self.budget is not None:
            return float(self.budget)
        return 0.0 if self.repair == "seam" else DEFAULT_BUDGET

    def num_chosen(self, num_spliced: int) -> int:
        """Tokens the repair recomputes of a segment whose seam plan splices ``num_spliced``: the budget's share,
        rounded up (a share within 1e-9 of an integer counts as that integer).

        >>> TurnPolicy(repair="deviation", budget=0.05).num_chosen(65), TurnPolicy().num_chosen(65)
        (4, 0)
        """
        share = self.repair_budget * num_spliced
        return min(num_spliced, math.ceil(share - 1e-9))
