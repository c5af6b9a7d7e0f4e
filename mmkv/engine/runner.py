"""``ModelRunner``: the model work of an engine step, and the tensors it needs.

Two kinds of work, both on the engine's one thread:

- a request's **prefill** (``prefill``): ``turn_steps`` over its live cache (matching prefix, plan, splices
  re-rotated, repairs, store writes), one chunk of at most ``prefill_chunk`` computed tokens per call, so the
  running requests decode between the chunks;
- one **batched decode** forward (``decode``) over every running request's pending token, each at its own next
  M-RoPE position (``DecodeBatch``).

Knows nothing about queues or events (the ``Scheduler`` and ``EngineCore`` do); changes only the live caches it
is handed and its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch

from ..model.handle import ModelHandle
from ..runtime import TurnPolicy, TurnStores, turn_steps
from ..runtime.report import PrefillStats
from .batch import DecodeBatch
from .request import Request

__all__ = ["ModelRunner"]

Prefill = Generator[None, None, tuple[torch.Tensor, PrefillStats]]


class ModelRunner:
    """Prefills requests in chunks and decodes the running ones in one batch."""

    def __init__(
        self, handle: ModelHandle, turn_stores: Callable[[TurnPolicy], TurnStores], prefill_chunk: int | None
    ) -> None:
        """``turn_stores``: the stores a turn under a policy reads and writes (``TurnStores``)."""
        self.handle, self.turn_stores, self.prefill_chunk = handle, turn_stores, prefill_chunk
        self.batch = DecodeBatch(handle)
        self._prefills: dict[int, Prefill] = {}  # id(request) -> its prefill in progress

    def prefill(self, request: Request) -> tuple[torch.Tensor, PrefillStats] | None:
        """Run the next chunk of ``request``'s prefill: None while chunks remain, else the prompt's last
        ``(vocab,)`` logits (on the model's device) and its ``PrefillStats``. Mutates ``request.live`` and the
        stores; on an exception the live cache is reset (emptied) and the exception propagates."""
        steps = self._prefills.get(id(request))
        if steps is None:
            turn_stores = self.turn_stores(request.policy)
            steps = self._prefills[id(request)] = turn_steps(
                self.handle, request.live, request.layout, request.images, turn_stores, request.policy,
                request.started, request.keep, self.prefill_chunk,
            )  # fmt: skip
        try:
            with torch.inference_mode():
                next(steps)
            return None
        except StopIteration as stop:
            del self._prefills[id(request)]
            return stop.value
        except BaseException:
            del self._prefills[id(request)]
            request.live.reset()
            raise

    def abandon(self, request: Request) -> None:
        """Stop ``request``'s prefill where it is (cancelled, out of time): its live cache is reset."""
        steps = self._prefills.pop(id(request), None)
        if steps is not None:
            steps.close()
            request.live.reset()

    def join(self, request: Request) -> None:
        """``request`` (prefilled, its first token chosen) becomes the batch's last row."""
        self.batch.join(request.live)

    def leave(self, request: Request) -> None:
        """``request`` leaves the batch: its live cache holds the prompt and every token the batch appended."""
        self.batch.leave(request.live)

    def decode(self, running: Sequence[Request]) -> torch.Tensor:
        """One batched forward over ``running`` (the batch's rows, in order): each one's pending token at its
        position. Returns ``(B, vocab)`` float32 logits on the model's device."""
        assert [r.live for r in running] == self.batch.rows, "running requests and batch rows differ"
        tokens = [r.decoder.pending for r in running]
        positions = [r.decoder.pending_position for r in running]
        with torch.inference_mode():
            return self.batch.step(tokens, positions)
