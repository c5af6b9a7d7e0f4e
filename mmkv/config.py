"""``SessionConfig``: how a session reuses work and what it bounds, validated on construction; and the argument
checks every public call shares (each error names the argument and what it takes)."""

from __future__ import annotations

from dataclasses import dataclass

from .cache import EncoderStore, KVStore
from .conversation import check_text
from .errors import StoreMismatchError
from .images import DEFAULT_MAX_PIXELS
from .runtime import ReusePolicy, Sampling, TurnPolicy

__all__ = ["SessionConfig", "check_int", "check_question", "check_sampling", "check_stores"]


def check_int(value: object, name: str, minimum: int) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) ``>= minimum``; else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_question(question: object) -> str:
    """``question`` if it is non-empty text; ``TypeError`` / ``ValueError`` naming the argument otherwise."""
    check_text(question, "question")
    if not question.strip():
        raise ValueError("question must not be empty")
    return question


def check_sampling(sampling: object) -> Sampling:
    """``sampling`` if it is a ``Sampling``; else ``TypeError`` naming the argument."""
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be an mmkv.runtime.Sampling, got {type(sampling).__name__}")
    return sampling


def check_stores(store, encoder_store) -> tuple[KVStore, EncoderStore]:
    """The two stores a session uses (fresh in-memory ones for ``None``); ``StoreMismatchError`` for a store of
    the wrong kind (an ``EncoderStore`` passed as the KV store, or the reverse)."""
    store = KVStore() if store is None else store
    encoder_store = EncoderStore() if encoder_store is None else encoder_store
    if not isinstance(store, KVStore):
        raise StoreMismatchError(f"store must be a KVStore (ImageKVStore), got {type(store).__name__}")
    if not isinstance(encoder_store, EncoderStore):
        raise StoreMismatchError(f"encoder_store must be an EncoderStore, got {type(encoder_store).__name__}")
    return store, encoder_store


@dataclass(frozen=True)
class SessionConfig:
    """How a session reuses work. Validated on construction."""

    reuse: ReusePolicy = "kv"  # "kv" (splice cached KV), "encoder" (cached vision outputs), "none"
    seam: int = 1  # kv: leading tokens of a spliced image recomputed in context (0: pure splice)
    window: int | None = None  # keep only the last N images in the prompt (None: all)
    rotate: bool = True  # kv: re-rotate spliced keys (False only for the no-rotation control)
    rotate_axes: tuple[int, ...] = (0, 1, 2)  # kv: axes re-rotated; (0,) is the temporal-only ablation
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # refuse larger inputs (decompression bombs)
    max_prompt_tokens: int | None = (
        None  # token budget of the prompt: oldest turns dropped to fit (None: none)
    )

    def __post_init__(self) -> None:
        self.policy  # noqa: B018 (validates reuse, seam, rotate_axes)
        if self.window is not None:
            check_int(self.window, "window", 1)
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate must be a bool, got {self.rotate!r}")
        check_int(self.max_image_pixels, "max_image_pixels", 1)
        if self.max_prompt_tokens is not None:
            check_int(self.max_prompt_tokens, "max_prompt_tokens", 1)

    @property
    def policy(self) -> TurnPolicy:
        """The per-turn reuse settings."""
        return TurnPolicy(self.reuse, self.seam, self.rotate, tuple(self.rotate_axes))
