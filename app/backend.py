"""The demo's state, testable without a browser: one model and store pair shared by every browser session
(``DemoBackend``) and one chat per browser session (``ChatState``: its ``mmkv.Session`` and the record of each
turn). What the page shows of them is ``app.format``.

All KV work happens in ``mmkv``: a turn validates the attached images, adds them and asks its ``Session``; when
asked to compare, it first times the same turn on a ``reuse="none"`` fork of the conversation (a cold full
recompute: empty live cache, no store). Example::

    from app.backend import DemoBackend, TurnSettings
    from app.format import format_stats, format_turn

    backend = DemoBackend("tiny-qwen3-vl")           # the model loads on first use
    chat = backend.new_chat()
    record = chat.turn("What is on the screen?", ["app/examples/screen_1.png"], TurnSettings(compare=True))
    print(format_turn(record))    # turn 1 [kv]: image 1 computed · TTFT 98.1 ms (kv) vs 301.4 ms (none, cold) ...
    record = chat.turn("And now?", ["app/examples/screen_1.png"], TurnSettings())
    print(format_turn(record))    # turn 2 [kv]: image 1 kept (live prefix), image 2 cache hit (memory) · ...
    print(format_stats(backend))  # a Markdown table of both stores' counters
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

import mmkv
from mmkv import Answer, MmkvError, ModelHandle, PrefillStats, Session, SessionConfig
from mmkv.cache import EncoderStore, KVStore
from mmkv.images import DEFAULT_MAX_PIXELS, ImageSource, load_image
from mmkv.messages import ToolCall
from mmkv.model.registry import SHIPPED_DIR
from mmkv.policy import REUSE_POLICIES, ReusePolicy
from mmkv.synthetic import synthetic_screenshot

__all__ = [
    "COLD_LABEL",
    "ChatState",
    "DemoBackend",
    "EmptyMessageError",
    "NoReuseTwin",
    "TurnRecord",
    "TurnSettings",
    "default_model",
    "load_upload",
]

COLD_LABEL = "none (cold recompute)"  # the plot's line for the "without reuse" measurements


def default_model() -> str:
    """``"small-qwen3-vl"`` when its trained checkpoint is in the repository, else ``"tiny-qwen3-vl"``."""
    return "small-qwen3-vl" if (SHIPPED_DIR / "small-qwen3-vl").exists() else "tiny-qwen3-vl"


class EmptyMessageError(ValueError):
    """A message without a question (attached images alone do not make a turn)."""


@dataclass(frozen=True)
class TurnSettings:
    """The page's controls, as one turn uses them. Validated on construction."""

    reuse: ReusePolicy = "kv"  # the session's reuse policy: "kv", "encoder" or "none"
    seam: int = 1  # kv: leading tokens of a spliced image recomputed in context
    window: int = 0  # keep the last N images in the prompt; 0 keeps all
    compare: bool = False  # also time the turn as a cold full recompute (reuse "none", empty live cache)
    max_new_tokens: int = 32  # answer length bound
    system: str = ""  # the system prompt (a change starts a new conversation)
    last_turn_only: bool = (
        False  # the prompt holds the system prompt and the latest turn only (the cache keeps all)
    )

    def __post_init__(self) -> None:
        if self.reuse not in REUSE_POLICIES:
            raise ValueError(f"reuse must be one of {REUSE_POLICIES}, got {self.reuse!r}")
        if self.seam < 0 or self.window < 0 or self.max_new_tokens < 1:
            raise ValueError(f"need seam >= 0, window >= 0, max_new_tokens >= 1; got {self}")

    @property
    def session_window(self) -> int | None:
        """The window as ``SessionConfig`` takes it (``None``: all images)."""
        return self.window or None


@dataclass(frozen=True)
class TurnRecord:
    """One answered turn of a chat."""

    number: int  # 1-based turn number since the chat was last cleared
    reuse: ReusePolicy  # the policy the turn was answered with
    answer: Answer  # what Session.ask returned (text, TTFT, token counts, where each image came from)
    cold_ttft_s: float | None  # TTFT of the same turn as a cold full recompute; None when not measured
    num_attached: int  # images attached to this turn's message
    num_images: int  # images in the conversation after the turn (the prompt holds the last `window` of them)

    @property
    def ttft_ms(self) -> float:
        """TTFT with the turn's reuse policy, in milliseconds."""
        return self.answer.ttft_s * 1e3

    @property
    def cold_ttft_ms(self) -> float | None:
        """TTFT of the cold full recompute in milliseconds, if measured."""
        return None if self.cold_ttft_s is None else self.cold_ttft_s * 1e3


class DemoBackend:
    """The model and the store pair every browser session shares; the model loads on first use (or ``load``).

    ``store_dir`` makes both stores persistent: image KV in ``store_dir``, vision outputs in
    ``store_dir/encoder``. ``lock`` serialises all model and store work (sessions and stores are not
    thread-safe; Gradio runs handlers in threads). Deep copies return the backend itself, so the ``ChatState``
    that ``gr.State`` deep-copies per browser session still shares it.
    """

    def __init__(
        self,
        model: str | None = None,
        store_dir: str | Path | None = None,
        *,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
        device: str | None = None,
    ) -> None:
        self.model_name = model or default_model()  # what mmkv.load is given
        self.store_dir = None if store_dir is None else Path(store_dir).expanduser()
        self.max_image_pixels = max_image_pixels  # uploads over this many pixels are refused
        self.device = device  # None: mmkv.load's default
        self.kv_store = KVStore(path=self.store_dir)
        self.encoder_store = EncoderStore(path=None if self.store_dir is None else self.store_dir / "encoder")
        self.lock = threading.RLock()
        self._handle: ModelHandle | None = None

    def __deepcopy__(self, memo: dict) -> DemoBackend:
        return self

    def load(self) -> ModelHandle:
        """The model, loaded and warmed up on the first call (later calls return it). Raises
        ``mmkv.ModelNotFoundError`` for a missing checkpoint."""
        with self.lock:
            if self._handle is None:
                handle = mmkv.load(self.model_name, device=self.device)
                _warm_up(handle)
                self._handle = handle
            return self._handle

    @property
    def is_loaded(self) -> bool:
        """Whether the model has been loaded."""
        return self._handle is not None

    def new_chat(self) -> ChatState:
        """A new, empty chat on this backend (the per-browser-session state)."""
        return ChatState(self)

    def clear_store(self) -> None:
        """Empty both stores, memory and disk (counters are kept). Live caches of open chats are untouched."""
        with self.lock:
            self.kv_store.clear()
            self.encoder_store.clear()

    def describe(self) -> str:
        """One Markdown line: the model and where the stores live."""
        store = (
            f"`{self.store_dir}` (persistent)"
            if self.store_dir
            else "in memory (start with `--store DIR` to persist)"
        )
        line = f"Model **{self.model_name}** · store {store}"
        if self.model_name.startswith("tiny-"):
            line += " · random weights: the answers are noise, the timings and cache hits are real"
        elif self.is_shipped_small:
            line += (
                "  \nIt was trained on this project's task suite and desktop episodes only: in the Agent episode "
                "tab it acts on the simulated ticket desk through tool calls; in the Chat tab, with the ticket "
                "policy as system prompt it gives the next action for a single UI panel, and with no system prompt "
                "it counts objects and names colours and shapes in simple pictures (the examples). It cannot chat, "
                "read text in screenshots or follow other instructions; the chat's prompt keeps only the latest "
                "turn (the cache still holds every image)."
            )
        return line

    @property
    def is_shipped_small(self) -> bool:
        """Whether the model is one of the shipped small checkpoints (trained on single-turn tasks)."""
        return self.model_name.startswith("small-")


def load_upload(path: str | Path, max_pixels: int) -> Image.Image:
    """The RGB image in the uploaded file ``path``; raises the ``mmkv`` image error naming the file by its name
    (the upload's temporary path is the browser's business, not the user's)."""
    path = Path(path)
    try:
        return load_image(path, max_pixels=max_pixels)
    except MmkvError as exc:
        message = str(exc).replace(repr(str(path)), "the file").replace(str(path), "the file")
        raise type(exc)(f"{path.name}: {message}") from exc


class ChatState:
    """One browser session's chat: its ``mmkv.Session`` (made on the first turn) and a record of every turn."""

    def __init__(self, backend: DemoBackend) -> None:
        self.backend = backend
        self.session: Session | None = None
        self.system = ""  # the system prompt the session was made with
        self.turns: list[TurnRecord] = []

    def check(self, text: str, files: Sequence[str | Path]) -> tuple[str, list[Image.Image]]:
        """The question (stripped) and the decoded images of a message, or the error it would raise: an
        ``EmptyMessageError`` for a blank question, the ``mmkv.MmkvError`` of the first bad image. Changes
        nothing."""
        question = text.strip()
        if not question:
            raise EmptyMessageError(
                "the message is empty: type a question (attached images are sent along with it)"
            )
        max_pixels = (
            self.backend.max_image_pixels if self.session is None else self.session.config.max_image_pixels
        )
        return question, [load_upload(path, max_pixels) for path in files]

    def turn(self, text: str, files: Sequence[str | Path], settings: TurnSettings) -> TurnRecord:
        """Attach ``files`` (image paths) and ask ``text``; returns the turn's record (also kept in ``turns``).

        Every file is validated (``check``) before any is added, so it raises what ``check`` raises; on any
        error the conversation is left as it was and the chat stays usable.
        """
        *_, record = self.stream_turn(text, files, settings)
        return record

    def stream_turn(
        self, text: str, files: Sequence[str | Path], settings: TurnSettings
    ) -> Iterator[str | TurnRecord]:
        """``turn``, yielding the answer's text piece by piece, then the ``TurnRecord``. Validates first (raises
        before yielding anything); an error leaves the conversation as it was."""
        question, images = self.check(text, files)
        with self.backend.lock:
            session = self._session(settings)
            before = session.fork()  # the conversation as it was, put back if anything below fails
            try:
                if settings.last_turn_only:
                    session.history_start = len(session.conversation.messages)
                for image in images:
                    session.add_image(image)
                cold = _cold_ttft(session, question) if settings.compare else None
                yield from session.stream(question, max_new_tokens=settings.max_new_tokens)
            except BaseException:
                self.session = before
                raise
            record = TurnRecord(
                len(self.turns) + 1,
                settings.reuse,
                session.last_answer,
                cold,
                len(images),
                len(session.images),
            )
        self.turns.append(record)
        yield record

    def clear(self) -> None:
        """Forget the conversation, the live cache and the turn records (the shared stores keep their entries)."""
        with self.backend.lock:
            if self.session is not None:
                self.session.clear()
            self.session = None  # the next turn starts a new one, with the system prompt it asks for
        self.turns.clear()

    def _session(self, settings: TurnSettings) -> Session:
        """The chat's session under ``settings``: made on first use (and anew when the system prompt changed:
        the page's history is cleared then), forked when another setting changed."""
        wanted = {"reuse": settings.reuse, "seam": settings.seam, "window": settings.session_window}
        if self.session is None or settings.system != self.system:
            backend = self.backend
            config = SessionConfig.of(**wanted, max_image_pixels=backend.max_image_pixels)
            self.session = Session(
                backend.load(), store=backend.kv_store, encoder_store=backend.encoder_store, config=config
            )
            self.system = settings.system
            if settings.system.strip():
                self.session.add_text(settings.system, role="system")
        elif any(getattr(self.session.config, name) != value for name, value in wanted.items()):
            self.session = self.session.fork(**wanted)
        return self.session


def _warm_up(handle: ModelHandle) -> None:
    """One untimed turn on a private ``reuse="none"`` session (the shared stores untouched), so that one-off
    start-up costs (allocations, kernel selection) land in no timed turn: the page's first timing would
    otherwise carry them, whichever of a turn and its without-reuse measurement ran first."""
    session = Session(handle, reuse="none")
    session.add_image(synthetic_screenshot(99, (224, 168)))
    session.next_token_logits("Warm up.")


def _cold_ttft(session: Session, question: str) -> float:
    """Seconds to the first-token logits of ``question`` on a ``reuse="none"`` fork (cold: no live cache, no
    store). ``session`` is unchanged."""
    cold = session.fork(reuse="none")
    started = time.perf_counter()
    cold.next_token_logits(question)
    return time.perf_counter() - started


class NoReuseTwin:
    """A ``reuse="none"`` session kept in step with another one (every message added to both), so that each turn
    can also be timed as it costs without reuse: the twin keeps its own live prefix (what a plain engine's
    prefix cache keeps) and never reads or writes the stores, so the shared stores and the other session are
    untouched. Example::

        twin = NoReuseTwin(handle, window=3, tools=tools)
        twin.add_text(policy, role="system")       # ... the same calls as on the session it follows
        stats = twin.prefill()                      # before the session's turn: what "none" pays for it
        twin.add_tool_calls(answer.tool_calls)      # after it: the session's answer, then the tool result

    ``prefill`` times bringing the twin's live cache up to the conversation as it stands: the prompt of the
    next turn without the generation prompt's few tokens (``PrefillStats.seconds``, the same clock as a turn's
    time to first token). Not thread-safe beyond ``Session``'s own lock; the demo holds the backend's lock.
    """

    def __init__(
        self, handle: ModelHandle, *, window: int | None, tools: Sequence[dict] | None = None
    ) -> None:
        self.session = Session(handle, reuse="none", window=window, tools=tools)  # private (unused) stores

    def add_text(self, text: str, role: str = "user") -> None:
        """``Session.add_text`` on the twin."""
        self.session.add_text(text, role=role)

    def add_image(self, image: ImageSource) -> None:
        """``Session.add_image`` on the twin (preprocessed now, as the followed session does, not in the timing)."""
        self.session.add_image(image)

    def add_tool_calls(self, calls: Sequence[ToolCall]) -> None:
        """The followed session's answer (its tool calls) as the twin's assistant message."""
        self.session.add_tool_calls(calls)

    def add_tool_result(self, tool_call_id: str, text: str, images: Sequence[ImageSource] = ()) -> None:
        """``Session.add_tool_result`` on the twin."""
        self.session.add_tool_result(tool_call_id, text, images)

    def prefill(self) -> PrefillStats:
        """Bring the twin's live cache up to its conversation, everything not in its live prefix computed (no
        stores); returns what it took (``seconds``: 0.0 when nothing was new)."""
        return self.session.prefill()
