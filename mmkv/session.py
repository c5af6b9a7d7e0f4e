"""``Session``: a multi-turn conversation over one model that never pays twice for the same picture.

A thin facade over a ``Conversation`` (what was said), a ``LiveCache`` (the KV held now) and, per turn,
``TurnStores`` (the stores): a turn lays the conversation out (``LayoutBuilder``) and runs its one sequence
through the engine the server uses (``mmkv.engine``: matching prefix, plan, one forward call, store writes,
then decoding). A failed turn leaves the conversation as it was and the live cache empty.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import torch

from .cache import EncoderStore, ImageDigest, KVStore
from .cache.memory import MemoryTier
from .config import SessionConfig, check_int, check_question, check_sampling, check_stores
from .conversation import Conversation
from .engine import Delta, Done, First, Request, run_alone
from .images import ImageSource
from .kv import KVSegment
from .kv.vision import ImageFeatures
from .messages import ConversationImage, ToolCall
from .model.handle import ModelHandle
from .prompt.blocks import LayoutBuilder
from .prompt.layout import PromptLayout
from .runtime import (
    GREEDY,
    Answer,
    DecodeOptions,
    LiveCache,
    PrefillStats,
    ReusePolicy,
    Sampling,
    TurnPolicy,
    TurnStores,
    pad_features,
    prepare_image,
    replace_span,
    resolve_features,
    run_turn,
)
from .runtime.grammar import GrammarSpec, constraint_for

__all__ = ["Session"]


def _exclusive(method):
    """Run ``method`` holding the session's lock: calls from several threads take turns, so a session shared by
    threads answers each call as some serial order of them would (never a mix)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class Session:
    """A conversation over one model with image and KV reuse; one live cache per session. Safe to share between
    threads: every public call holds the session's lock (calls take turns)."""

    def __init__(
        self, handle: ModelHandle, store: KVStore | None = None, reuse: ReusePolicy = "kv", seam: int = 1,
        window: int | None = None, *, encoder_store: EncoderStore | None = None, config: SessionConfig | None = None,
        tools: Sequence[Mapping] | None = None,
    ) -> None:  # fmt: skip
        """``store``/``encoder_store`` default to private in-memory stores; pass shared ones (optionally with a
        directory) to reuse images across sessions and processes. ``config`` overrides the keyword settings.
        ``tools`` (OpenAI function specs) are declared to the model (the template lists them in the system
        message); ``ask`` then records an answer made of ``<tool_call>`` blocks as the calls it makes."""
        self.handle = handle  # what mmkv.load returned: the model, its processor, family and fingerprint
        self.config = config or SessionConfig.of(reuse=reuse, seam=seam, window=window)
        self.store, self.encoder_store = check_stores(store, encoder_store)
        self._lock = threading.RLock()
        self.conversation = Conversation()
        self.conversation.set_tools(tools)
        self.live = LiveCache(handle)
        self.layouts = LayoutBuilder(handle)  # each message rendered once, the previous turn's prefix reused
        self._vision_inputs = MemoryTier(256 << 20)  # preprocessed, made at add_image (256 MB bound)
        self.last_prefill = PrefillStats()  # what the latest ask / next_token_logits / prefill took
        self.last_answer: Answer | None = None  # the latest ask's or stream's answer
        self.history_start = 0  # turns before this message are dropped from prompts (max_prompt_tokens)

    # ----------------------------------------------------------------------------------------- conversation
    messages = property(
        lambda self: self.conversation.to_chat(), doc="The conversation as plain dicts (a copy)."
    )
    images = property(
        lambda self: self.conversation.images, doc="The conversation's images, in order of adding."
    )
    field_values = property(
        lambda self: self.conversation.field_values, doc="Each named field's current value."
    )

    @_exclusive
    def add_text(
        self, text: str, role: str = "user", fields: dict[str, str] | None = None, *, new_message: bool = False
    ) -> None:  # fmt: skip
        """Append ``text`` as ``role`` (joined to the last message of that role unless ``new_message``).
        ``fields`` names editable values (``add_text("role: {role}", fields={"role": "admin"})``, changed later by
        ``edit``). Raises ``TypeError``/``ValueError`` with the session unchanged."""
        self.conversation.add_text(text, role, fields, new_message=new_message)

    @_exclusive
    def add_segment(self, segment: KVSegment, seam: int = 1, role: str = "user") -> None:
        """Append a precompiled text segment (``mmkv.text.precompile``) as ``role``'s text: under ``kv`` its KV
        is spliced where it lands (``seam`` tokens recomputed); where the tokens differ it is computed."""
        from .text.compose import TextSegment

        if not isinstance(segment, TextSegment):
            raise TypeError(
                f"add_segment takes a TextSegment from mmkv.text.precompile, got {type(segment).__name__}"
            )
        check_int(seam, "seam", 0)
        self.conversation.add_text(segment.template, role, dict(segment.fields), segment=segment, seam=seam)

    @_exclusive
    def add_image(self, image: ImageSource, role: str = "user") -> ImageDigest:
        """Append an image (PIL image, path or bytes) to the current ``role`` message; returns its digest. Raises
        an ``mmkv.ImageError`` / ``UnsupportedInputError`` for bad input, leaving the session unchanged."""
        record = self._prepared(image)
        self.conversation.add_image(record, role)
        return record.digest

    @_exclusive
    def add_tool_calls(self, calls: Sequence[ToolCall], text: str = "") -> None:
        """Append an assistant message making ``calls`` (after ``text``): a history an agent resends."""
        self.conversation.add_tool_calls(calls, text)

    @_exclusive
    def add_tool_result(self, tool_call_id: str, text: str = "", images: Sequence[ImageSource] = ()) -> None:
        """Append the result of call ``tool_call_id``: ``text``, then ``images`` (a screenshot). Results after one
        another share one tool message. Bad input raises with the session unchanged."""
        self.conversation.add_tool_result(tool_call_id, text, [self._prepared(image) for image in images])

    @_exclusive
    def fork(self, **settings) -> Session:
        """A new session over the same model and stores with a copy of this conversation and an empty live
        cache; ``settings`` override this session's ``SessionConfig`` fields (e.g. ``reuse="none"``)."""
        config = self.config.replaced(**settings)
        other = Session(self.handle, self.store, encoder_store=self.encoder_store, config=config)
        other.conversation, other.history_start = self.conversation.fork(), self.history_start
        return other

    @_exclusive
    def clear(self) -> None:
        """Forget the conversation and the live cache (the stores keep their entries)."""
        self.conversation.clear()
        self.live.reset()

    # ------------------------------------------------------------------------------------------------ turns
    @_exclusive
    def ask(
        self, question: str | None, max_new_tokens: int = 32, sampling: Sampling = GREEDY, *,
        stops: Sequence[str] = (), logprobs: int | None = None, grammar: GrammarSpec | None = None,
    ) -> Answer:  # fmt: skip
        """Ask ``question`` as the user (None: answer the conversation as it stands, e.g. after a tool result),
        decode the answer, append both to the conversation (with tools declared, an answer made of tool calls as
        those calls: ``Answer.tool_calls``). ``stops`` end the answer before the first of these strings;
        ``logprobs`` (0-20) adds the model's log-probabilities per token; ``grammar`` keeps the answer within one
        (``mmkv.runtime.grammar``: ``json_object()``, ``json_schema(schema)``, ``tool_calls(tools, "required")``).
        On an error the conversation is left as it was. Arguments are checked first."""
        for _ in self.stream(
            question, max_new_tokens, sampling, stops=stops, logprobs=logprobs, grammar=grammar
        ):
            pass  # fmt: skip
        return self.last_answer

    def stream(
        self, question: str | None, max_new_tokens: int = 32, sampling: Sampling = GREEDY, *,
        stops: Sequence[str] = (), logprobs: int | None = None, grammar: GrammarSpec | None = None,
    ) -> Iterator[str]:  # fmt: skip
        """``ask``, yielding the answer's text as it is decoded; ``last_answer`` once exhausted. Holds the lock
        until then; closed early, the conversation is left as it was. Arguments are checked at the call."""
        if question is not None:
            check_question(question)
        check_sampling(sampling)
        options = DecodeOptions(
            check_int(max_new_tokens, "max_new_tokens", 1), sampling, tuple(stops), logprobs
        )
        constraint = None if grammar is None else constraint_for(self.handle, grammar)
        return self._turn(question, options, constraint)

    def _turn(self, question: str | None, options: DecodeOptions, constraint) -> Iterator[str]:
        """One turn as the server runs it: the session's one sequence through an engine of its own
        (``mmkv.engine.run_alone``) over the session's live cache; records the turn once it ends."""
        with self._lock:
            layout, history_start = self._layout(question, True, self.config.policy)  # 1. lay out
            request = Request(layout, self.conversation.images, self.config.policy, options, lambda _: None,
                              constraint, live=self.live)  # fmt: skip
            for event in run_alone(self.handle, request, self._turn_stores):  # 2-6. prefill, decode
                if isinstance(event, First):
                    self.last_prefill = event.stats
                elif isinstance(event, Delta) and event.step.delta:
                    yield event.step.delta
                elif isinstance(event, Done):
                    answer = event.answer
            self.history_start = history_start
            if question is not None:
                self.conversation.add_text(question, "user")
            calls = self.conversation.add_answer(answer.text, trusted=constraint is not None)
            self.last_answer = replace(answer, tool_calls=calls)

    @_exclusive
    def next_token_logits(self, question: str) -> torch.Tensor:
        """``(vocab,)`` float32 logits of the first answer token to ``question``. The conversation is unchanged
        (the live cache may hold the question afterwards; the next turn reuses what still matches)."""
        check_question(question)
        with self.live.dropped_on_error(), torch.inference_mode():
            return self._bring_up_to_date(question)[0]

    @_exclusive
    def prefill(self, reuse: ReusePolicy | None = None) -> PrefillStats:
        """Bring the live cache up to the conversation as it stands, with no question (``reuse`` overrides the
        policy for this call); nothing is computed when the cache is current."""
        with self.live.dropped_on_error(), torch.inference_mode():
            layout = self.prompt_layout(None, add_generation_prompt=False)
            if layout.num_tokens == 0 or self.live.holds(layout):
                return PrefillStats(prompt_tokens=layout.num_tokens, reused=layout.num_tokens)
            return self._bring_up_to_date(None, add_generation_prompt=False, reuse=reuse)[1]

    @_exclusive
    def edit(self, name: str, value: str, strategy: str = "suffix", **options):
        """Change field ``name`` to ``value`` by ``strategy`` ("erratum", "in_place", "selective" with ``k`` and
        ``rank``, "suffix", "full"; see ``mmkv.text.edit``); returns an ``mmkv.text.EditReport``."""
        from .text.edit import edit_field

        return edit_field(self, name, value, strategy, **options)

    # --------------------------------------------------------------------------------------------- rendering
    @_exclusive
    def render(
        self, question: str | None = None, add_generation_prompt: bool = True
    ) -> tuple[torch.Tensor, list]:
        """The prompt's token ids ``(L,)`` and the conversation indices of the images in it (after the window),
        with ``question`` joined to the conversation as the user's last words. Changes nothing."""
        layout = self.prompt_layout(question, add_generation_prompt)
        return layout.token_ids, list(layout.image_order)

    @_exclusive
    def prompt_layout(
        self, question: str | None = None, add_generation_prompt: bool = True, trace: bool = False
    ) -> PromptLayout:
        """This turn's ``PromptLayout`` (ids, positions, pieces; with ``trace`` the token spans of text items and
        fields, and where precompiled segments sit). Changes nothing."""
        return self.layouts.build(
            self.conversation, question=question, add_generation_prompt=add_generation_prompt,
            window=self.config.window, trace=trace, history_start=self.history_start,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ the turn
    def _layout(self, question: str | None, add_generation_prompt: bool, policy) -> tuple[PromptLayout, int]:
        """Step 1: the layout within ``max_prompt_tokens`` (traced if segments may splice), its history start."""
        trace = policy.splices_kv and self.conversation.has_segments()
        return self.layouts.build_within(
            self.config.max_prompt_tokens, self.conversation, question=question, trace=trace,
            add_generation_prompt=add_generation_prompt, window=self.config.window, history_start=self.history_start,
        )  # fmt: skip

    def _bring_up_to_date(
        self, question: str | None, add_generation_prompt: bool = True, reuse: ReusePolicy | None = None
    ) -> tuple[torch.Tensor, PrefillStats]:
        """Steps 1-5 of a turn without its answer (``mmkv.runtime.turn``); returns the last prompt token's logits
        (on the host) and what it took."""
        started = time.perf_counter()
        policy = self.config.policy if reuse is None else replace(self.config.policy, reuse=reuse)
        layout, self.history_start = self._layout(question, add_generation_prompt, policy)  # 1. lay out
        logits, self.last_prefill = run_turn(self.handle, self.live, layout, self.conversation.images,
                                             self._turn_stores(policy), policy, started)  # 2-5.  # fmt: skip
        return logits, self.last_prefill

    # ----------------------------------------------------------------------- the edit protocol (mmkv.text.edit)
    @_exclusive
    def replace_span(
        self, layout: PromptLayout, begin: int, old_end: int, new_end: int, extra: Sequence[int] = ()
    ) -> None:
        """``mmkv.runtime.replace_span`` on this session's live cache (dropped if it fails)."""
        turn_stores = self._turn_stores(self.config.policy)
        with self.live.dropped_on_error(), torch.inference_mode():
            replace_span(self.handle, self.live, layout, self.conversation.images, turn_stores, begin, old_end,
                         new_end, extra, self.config.policy)  # fmt: skip

    @_exclusive
    def pad_features(self, layout: PromptLayout, indices: Sequence[int]) -> list[ImageFeatures]:
        """The vision outputs of the image pads among prompt ``indices``, in order (one record per image)."""
        features = pad_features(layout, [(int(i), 1) for i in sorted(set(indices))])
        return resolve_features(features, self.conversation.images, self._turn_stores(self.config.policy))

    def _prepared(self, image: ImageSource) -> ConversationImage:
        return prepare_image(self.handle, image, self.config.max_image_pixels, self.config.policy, self.encoder_store,
                             self._vision_inputs)  # fmt: skip

    def _turn_stores(self, policy: TurnPolicy) -> TurnStores:
        return TurnStores(self.handle, self.store, self.encoder_store, policy, self._vision_inputs)
