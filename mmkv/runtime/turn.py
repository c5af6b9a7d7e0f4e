"""``run_turn``: bring a live cache up to one prompt with the least work, the steps every turn takes (a
``Session``'s and the server's alike), given the prompt's ``PromptLayout``.

2. keep the live cache's **matching prefix** (same ids and positions: exact) and cut the rest, keeping text cut
   off whole aside for ``kv`` reuse;
3. **plan** every later token (``plan_turn``: spliced from a store or the cut-off text, or computed), then
   **repair** it (``repair_plan``: the policy's budget of spliced tokens computed instead);
4. **execute** the plan (one forward call, masks bounded);
5. **flush** the turn's store writes, after the first token's logits are on the host.

(Step 1, laying the prompt out, and step 6, decoding (``Decoder``), are the caller's.) On an exception the live cache is in
an undefined state: run it inside ``LiveCache.dropped_on_error``.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence

import torch

from ..errors import PromptTooLongError
from ..messages import ConversationImage
from ..model.handle import ModelHandle
from ..policy import TurnPolicy
from ..prompt.layout import PromptLayout
from .execute import drain, execute_steps
from .live import LiveCache
from .plan import plan_turn
from .repair import repair_plan
from .report import PrefillStats
from .stores import TurnStores

__all__ = ["check_positions", "run_turn", "turn_steps"]


def check_positions(handle: ModelHandle, layout: PromptLayout) -> None:
    """``PromptTooLongError`` unless ``layout`` fits the model's ``max_position_embeddings``."""
    if layout.num_positions > handle.max_positions:
        raise PromptTooLongError(
            f"the prompt needs {layout.num_positions} positions; this model has {handle.max_positions} "
            "(max_position_embeddings). Use a smaller window or fewer turns"
        )


def run_turn(
    handle: ModelHandle,
    live: LiveCache,
    layout: PromptLayout,
    images: Sequence[ConversationImage],
    turn_stores: TurnStores,
    policy: TurnPolicy,
    started: float | None = None,
    keep: int | None = None,
) -> tuple[torch.Tensor, PrefillStats]:
    """Steps 2-5 for ``layout`` at once (``turn_steps`` without chunks): the ``(vocab,)`` float32 logits of the
    prompt's last token, on the host, and what it took. Mutates ``live`` and the stores."""
    logits, stats = drain(turn_steps(handle, live, layout, images, turn_stores, policy, started, keep))
    return logits.cpu(), stats


def turn_steps(
    handle: ModelHandle,
    live: LiveCache,
    layout: PromptLayout,
    images: Sequence[ConversationImage],
    turn_stores: TurnStores,
    policy: TurnPolicy,
    started: float | None = None,
    keep: int | None = None,
    chunk_tokens: int | None = None,
) -> Generator[None, None, tuple[torch.Tensor, PrefillStats]]:
    """Steps 2-5 for ``layout`` (whose images are ``images[i]``), as a generator that yields between forward
    calls of at most ``chunk_tokens`` computed tokens (``execute_steps``; an engine decodes other sequences
    there) and returns the ``(vocab,)`` float32 logits of the prompt's last token, on the model's device, and
    what it took (``seconds`` counted from ``started``, default now). ``keep``: the matching prefix when the
    caller already computed it (the server's pool checkout: it is ``live.matching_prefix(layout)``, not
    computed twice). Mutates ``live`` (it holds the prompt afterwards) and the stores (the turn's writes)."""
    started = time.perf_counter() if started is None else started
    check_positions(handle, layout)
    # 2. matching prefix
    keep = live.matching_prefix(layout) if keep is None else keep
    reusable_text = live.truncate(keep, collect_text=policy.splices_kv)
    # 3. plan
    plan = plan_turn(layout, images, keep, policy, turn_stores, reusable_text)
    plan, repair = repair_plan(handle, live, plan, layout, images, turn_stores)  # the budget beyond the seam
    # 4. execute
    forward_before = live.forward_seconds
    logits = yield from execute_steps(handle, live, plan, layout, images, turn_stores, chunk_tokens)
    stats = PrefillStats(
        layout.num_tokens, plan.prefilled, plan.reused, plan.images, time.perf_counter() - started,
        live.forward_seconds - forward_before, repair,
    )  # fmt: skip
    # 5. store writes, after the first token is known
    turn_stores.flush(live, plan.writes)
    return logits, stats
