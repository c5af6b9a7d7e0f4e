"""``ServerConfig``: what ``mmkv serve`` serves and the bounds it keeps, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import check_int
from ..images import DEFAULT_MAX_PIXELS
from ..runtime import TurnPolicy

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    """One server's settings (``mmkv serve --help`` lists them as flags)."""

    model: str  # what mmkv.load is given; also the served model name
    served_names: tuple[str, ...] = ()  # more names the "model" field may carry (listed by /v1/models)
    host: str = "127.0.0.1"
    port: int = 8000
    stores: tuple[str, ...] = ()  # tiers under memory, in order: directories and/or redis:// URLs
    policy: TurnPolicy = field(default_factory=TurnPolicy)  # default reuse policy and seam (a request may
    # override them: {"mmkv": {"reuse": ..., "seam": ...}})
    allowed_media_domains: tuple[
        str, ...
    ] = ()  # hosts http(s) image URLs may name (exact match); none by default
    allowed_local_media_path: Path | None = None  # file:// image URLs must lie under this directory
    max_queue: int = 16  # requests waiting for the model beyond the one it runs; more get 503
    api_key: str | None = None  # when set, requests need "Authorization: Bearer <key>"
    pool_bytes: int = 1 << 30  # live caches kept between requests (LRU by bytes)
    request_timeout_s: float = 300.0  # a request still unanswered after this gets 504 / a stream error event
    max_body_bytes: int = 64 << 20  # request bodies over this get 413
    max_image_bytes: int = 20 << 20  # encoded images over this get 413
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # decoded images over this get 413
    max_images: int = 64  # images per request
    max_tokens: int = 4096  # bound on max_tokens / max_completion_tokens
    fetch_timeout_s: float = 10.0  # http(s) image fetches
    device: str | None = None  # mmkv.load's device (default: CUDA when available)
    extra: dict = field(default_factory=dict, compare=False)  # reserved

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty name")
        check_int(self.port, "port", 0)
        for name in ("max_queue", "pool_bytes", "max_body_bytes", "max_image_bytes", "max_image_pixels",
                     "max_images", "max_tokens"):  # fmt: skip
            check_int(getattr(self, name), name, 0 if name in ("max_queue", "pool_bytes") else 1)
        if self.request_timeout_s <= 0 or self.fetch_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if not isinstance(self.policy, TurnPolicy):
            raise TypeError(f"policy must be an mmkv.runtime.TurnPolicy, got {type(self.policy).__name__}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may use: the served model first."""
        return (self.model, *(n for n in self.served_names if n != self.model))
