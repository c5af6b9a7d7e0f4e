"""``SessionConfig``: how a session reuses work and what it bounds, validated on construction; and the argument
checks every public call shares (each error names the argument and what it takes)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .cache import EncoderStore, KVStore
from .errors import StoreMismatchError
from .images import DEFAULT_MAX_PIXELS
from .messages import check_text
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
        raise StoreMismatchError(f"store must be a KVStore, got {type(store).__name__}")
    if not isinstance(encoder_store, EncoderStore):
        raise StoreMismatchError(f"encoder_store must be an EncoderStore, got {type(encoder_store).__name__}")
    return store, encoder_store


_POLICY_FIELDS = frozenset(f.name for f in fields(TurnPolicy))


@dataclass(frozen=True)
class SessionConfig:
    """How a session reuses work (its ``TurnPolicy``) and what it bounds. Validated on construction.

    ``SessionConfig.of(reuse="kv", seam=1, window=4)`` builds one from flat settings (the policy's and the
    session's alike); ``config.replaced(reuse="none")`` changes some."""

    policy: TurnPolicy = field(default_factory=TurnPolicy)  # reuse, seam, rotation (the per-turn settings)
    window: int | None = None  # keep only the last N images in the prompt (None: all)
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # refuse larger inputs (decompression bombs)
    max_prompt_tokens: int | None = (
        None  # token budget of the prompt: oldest turns dropped to fit (None: none)
    )

    def __post_init__(self) -> None:
        if not isinstance(self.policy, TurnPolicy):
            raise TypeError(f"policy must be an mmkv.runtime.TurnPolicy, got {type(self.policy).__name__}")
        if self.window is not None:
            check_int(self.window, "window", 1)
        check_int(self.max_image_pixels, "max_image_pixels", 1)
        if self.max_prompt_tokens is not None:
            check_int(self.max_prompt_tokens, "max_prompt_tokens", 1)

    @classmethod
    def of(cls, **settings) -> SessionConfig:
        """A config from flat settings: ``TurnPolicy`` fields (``reuse``, ``seam``, ``rotate``, ...) and this
        class's own; ``TypeError`` naming an unknown one."""
        return cls().replaced(**settings)

    def replaced(self, **settings) -> SessionConfig:
        """This config with some flat settings changed (see ``of``)."""
        unknown = set(settings) - _POLICY_FIELDS - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown session setting(s) {sorted(unknown)}")
        policy = {k: v for k, v in settings.items() if k in _POLICY_FIELDS}
        own = {k: v for k, v in settings.items() if k not in _POLICY_FIELDS}
        if "rotate_axes" in policy:
            policy["rotate_axes"] = tuple(policy["rotate_axes"])
        return replace(self, policy=replace(self.policy, **policy) if policy else self.policy, **own)

    @property
    def reuse(self) -> ReusePolicy:
        """The policy's reuse level (read-only; see ``policy``)."""
        return self.policy.reuse

    @property
    def seam(self) -> int:
        """The policy's seam (read-only; see ``policy``)."""
        return self.policy.seam
