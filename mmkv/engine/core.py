"""``EngineCore``: continuous batching over spliced sequences, one ``step()`` at a time.

A step reads as the three owners it drives::

    plan = scheduler.schedule()      # 1. who leaves, who is admitted, who prefills, who decodes
    work = runner.run(plan)          # 2. one prefill chunk, one batched decode forward
    postprocess(plan, work)          # 3. tokens chosen per request, events, finished requests released

so a new request's prefill runs between the running requests' decode steps (no request waits for another to
finish) and a long prompt is cut into chunks (``EngineConfig.prefill_chunk``). Each request keeps its own
sampling (seeded), logit rules, grammar, stops and logprobs (its ``Decoder``); a request cancelled or past its
deadline leaves at the next step, the others undisturbed.

Live caches come from the request (a ``Session``'s own) or, for the server, from its ``LivePool``: checked out
at admission (the longest matching prefix, computed once and kept on the request) and checked back in when the
request leaves, so a conversation's next turn continues from it while other requests run.

Not thread-safe except ``add`` and ``withdraw``: one thread steps it (the server's model thread, or the
``Session`` call that owns it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from ..model.handle import ModelHandle
from ..runtime import Decoder, TurnPolicy, TurnStores
from ..runtime.decode import greedy_tokens
from .events import Delta, Done, Failed, First, Started
from .request import Request
from .runner import ModelRunner
from .scheduler import EngineConfig, Scheduler, StepPlan

__all__ = ["ALONE", "EngineCore", "run_alone"]

ALONE = EngineConfig(max_batch=1, prefill_chunk=None, max_waiting=1)  # one sequence, one prefill call


class EngineCore:
    """The scheduler, the model runner and the step that drives them."""

    def __init__(
        self,
        handle: ModelHandle,
        config: EngineConfig,
        turn_stores: Callable[[TurnPolicy], TurnStores],
        pool=None,
    ) -> None:
        """``turn_stores``: a turn's stores for its policy; ``pool``: a ``LivePool`` for requests that bring no live
        cache (the server's), or None."""
        self.handle, self.config, self.pool = handle, config, pool
        self.scheduler = Scheduler(config, handle.kv_bytes_per_token)
        self.runner = ModelRunner(handle, turn_stores, config.prefill_chunk)
        self._pooled: set[int] = set()  # id() of requests whose live cache is the pool's
        self.decode_steps = 0  # batched decode forwards run
        self.last_decode_rows = 0  # rows of the last step's decode forward (0: none ran)

    def add(self, request: Request) -> None:
        """Queue ``request`` (any thread); ``QueueFull`` when the queue is at its bound."""
        if request.live is None and self.pool is None:
            raise ValueError("a request needs a live cache when the engine has no pool")
        self.scheduler.add(request)

    def withdraw(self, request: Request) -> None:
        """Drop ``request`` (any thread): at once while it waits, else at the next step."""
        self.scheduler.withdraw(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """One step: schedule -> run -> postprocess. Returns the requests that finished in it."""
        plan = self.scheduler.schedule()  # 1.
        finished = self._drop(plan)
        if plan.admitted is not None:
            self._admit(plan.admitted)
        prefilled, logits, decode_error = self._run(plan, finished)  # 2.
        finished += self._postprocess(plan, prefilled, logits, decode_error)  # 3.
        return finished

    # ---------------------------------------------------------------------------------------------- 1.
    def _drop(self, plan: StepPlan) -> list[Request]:
        for request in plan.dropped:
            if request.is_expired and not request.is_cancelled:
                request.emit(Failed(TimeoutError("the request timed out in the queue")))
        return list(plan.dropped)

    def _admit(self, request: Request) -> None:
        """Started; the live cache checked out of the pool when the request brings none."""
        request.queue_s = time.monotonic() - request.submitted
        request.started = time.perf_counter()
        if request.live is None:
            request.live, request.keep = self.pool.checkout(request.layout)
            self._pooled.add(id(request))
        request.emit(Started(request.queue_s))

    # ---------------------------------------------------------------------------------------------- 2.
    def _run(self, plan: StepPlan, finished: list[Request]):
        """One prefill chunk, then one decode forward. Returns (the prefill's (logits, stats) when its prompt is
        done, the decode logits, the decode forward's exception)."""
        prefilled, logits, error = None, None, None
        self.last_decode_rows = len(plan.decode)
        request = plan.prefill
        if request is not None:
            if request.should_stop():
                self.runner.abandon(request)
                self._leave(request, finished, check_in=False)
            else:
                try:
                    prefilled = self.runner.prefill(request)
                except Exception as exc:  # the live cache was reset: a fresh one goes back to nobody
                    self._fail(request, exc, finished)
        if plan.decode:
            try:
                logits = self.runner.decode(plan.decode)
                self.decode_steps += 1
            except Exception as exc:
                error = exc
        return prefilled, logits, error

    # ---------------------------------------------------------------------------------------------- 3.
    def _postprocess(
        self, plan: StepPlan, prefilled, logits: torch.Tensor | None, decode_error
    ) -> list[Request]:
        finished: list[Request] = []
        chosen = {}  # row -> token, for the plain greedy rows: one argmax and one transfer for all of them
        if decode_error is None and (
            rows := [i for i, r in enumerate(plan.decode) if r.decoder.is_plain_greedy]
        ):
            chosen = dict(zip(rows, greedy_tokens(self.handle, logits[rows]), strict=True))
        for row, request in enumerate(plan.decode):  # the running requests: the next token each
            if decode_error is not None:
                self.runner.leave(request)
                request.live.reset()
                self._fail(request, decode_error, finished)
                continue
            self._advance(request, logits[row], finished, chosen.get(row))
        if prefilled is not None:  # the admitted request's first token, then it joins the batch
            request = plan.prefill
            prompt_logits, stats = prefilled
            request.stats, request.ttft_s = stats, time.perf_counter() - request.started
            request.emit(First(stats, request.ttft_s))
            try:
                request.decoder = Decoder(self.handle, request.live, prompt_logits, request.options,
                                          constraint=request.constraint, should_stop=request.should_stop)  # fmt: skip
            except Exception as exc:
                self._fail(request, exc, finished)
                return finished
            self.scheduler.prefilled(request)
            self.runner.join(request)
            self._advance(request, None, finished)
        return finished

    def _advance(
        self, request: Request, logits: torch.Tensor | None, finished: list[Request], token: int | None = None
    ) -> None:
        """Choose ``request``'s next token (``token``: chosen already, with the batch's other greedy rows); an
        answer that ended leaves the batch."""
        decoder = request.decoder
        try:
            step = decoder.advance(logits, token)
        except Exception as exc:  # a grammar that cannot go on, ...: this request only
            self.runner.leave(request)
            request.live.reset()
            self._fail(request, exc, finished)
            return
        if step is not None:
            request.emit(Delta(step))
        if not decoder.finished:
            return
        self.runner.leave(request)
        self._leave(request, finished)
        if decoder.finish_reason != "cancelled":
            total = time.perf_counter() - request.started
            request.emit(Done(decoder.answer(request.stats, request.ttft_s, total, request.queue_s)))

    def _fail(self, request: Request, error: BaseException, finished: list[Request]) -> None:
        self._leave(request, finished, check_in=False)
        request.emit(Failed(error))

    def _leave(self, request: Request, finished: list[Request], check_in: bool = True) -> None:
        """``request`` leaves the engine; a pool's live cache goes back to it (unless it was reset)."""
        self.scheduler.finish(request)
        if id(request) in self._pooled:
            self._pooled.discard(id(request))
            if check_in and request.live.num_tokens:
                self.pool.checkin(request.live)
        finished.append(request)


def run_alone(
    handle: ModelHandle, request: Request, turn_stores: Callable[[TurnPolicy], TurnStores]
) -> Iterator[Delta | Done | First | Started]:
    """``request`` (bringing its own live cache) through an engine of its own (``ALONE``), its events as they
    come (a ``Session``'s turn); a ``Failed`` event is raised as its error instead. Stops when it finishes;
    closed early, the request is simply dropped (its live cache holds its prompt, consistent)."""
    events: list = []
    request.emit = events.append
    core = EngineCore(handle, ALONE, turn_stores)
    core.add(request)
    while not request.is_finished:
        core.step()
        for event in events:
            if isinstance(event, Failed):
                raise event.error
            yield event
        events.clear()
