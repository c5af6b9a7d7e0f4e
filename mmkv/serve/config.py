"""``ServerConfig``: what ``mmkv serve`` serves and the bounds it keeps, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import check_int
from ..engine import EngineConfig
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
    max_queue: int = 16  # requests waiting for the model beyond those it runs; more get 503
    max_batch: int = 8  # requests prefilling or decoding at once (1: one at a time, in order of arrival)
    max_batch_kv_bytes: int = 2 << 30  # the decode batch's KV, rows padded to the longest
    prefill_chunk: int = 512  # prompt tokens computed per engine step while other requests decode
    api_key: str | None = None  # when set, every route needs "Authorization: Bearer <key>" (but see open_*)
    open_health: bool = False  # with api_key: /health answers without it
    open_metrics: bool = False  # with api_key: /metrics answers without it
    # memory the server holds, each bounded (defaults: about 5 GiB beside the model, for a 24 GB machine)
    pool_bytes: int = 1 << 30  # live caches kept between requests (LRU by bytes)
    kv_memory_bytes: int = 2 << 30  # the KV store's memory tier (image KV, precompiled text)
    encoder_memory_bytes: int = 512 << 20  # the encoder store's memory tier (vision-tower outputs)
    image_cache_bytes: int = 256 << 20  # decoded image records by bytes, and preprocessed vision inputs: each
    decode_budget_bytes: int = 1 << 30  # pixels being decoded at once, all requests together (more wait)
    layout_cache_bytes: int = 64 << 20  # rendered message blocks and earlier requests' layouts (LRU)
    grammar_cache_bytes: int = 256 << 20  # checked schemas and compiled grammars (LRU, the engine's estimate)
    # time and connections
    request_timeout_s: float = 300.0  # one deadline from a request's arrival: body, fetches, images, queue,
    # prefill, decode; past it: 504 (or a stream's error event)
    header_timeout_s: float = 10.0  # a connection whose request headers are not complete by then is closed
    body_timeout_s: float = 60.0  # a request body not received by then gets 408
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    drain_timeout_s: float = 30.0  # on SIGTERM: how long the requests held may take before the server exits
    max_connections: int = 512  # open connections at once; more are closed at once
    # sizes
    max_body_bytes: int = 64 << 20  # request bodies over this get 413
    max_image_bytes: int = 20 << 20  # encoded images over this get 413
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # decoded images over this get 413
    max_images: int = 64  # images per request
    max_tokens: int = 4096  # bound on max_tokens / max_completion_tokens
    max_schema_bytes: int = 64 << 10  # a request's JSON schemas (response format, tools' parameters) together
    fetch_timeout_s: float = 10.0  # one http(s) image fetch, redirects included
    max_fetches: int = 8  # http(s) image fetches at once (their own threads)
    device: str | None = None  # mmkv.load's device (default: CUDA when available)
    extra: dict = field(default_factory=dict, compare=False)  # reserved

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty name")
        check_int(self.port, "port", 0)
        for name in ("max_queue", "pool_bytes", "max_body_bytes", "max_image_bytes", "max_image_pixels",
                     "max_images", "max_tokens", "kv_memory_bytes", "encoder_memory_bytes", "image_cache_bytes",
                     "decode_budget_bytes", "layout_cache_bytes", "grammar_cache_bytes", "max_schema_bytes",
                     "max_connections", "max_fetches", "max_batch", "max_batch_kv_bytes"):  # fmt: skip
            check_int(getattr(self, name), name, 0 if name in ("max_queue", "pool_bytes") else 1)
        for name in (
            "request_timeout_s",
            "fetch_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "keep_alive_s",
            "drain_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        check_int(self.prefill_chunk, "prefill_chunk", 16)
        if not isinstance(self.policy, TurnPolicy):
            raise TypeError(f"policy must be an mmkv.runtime.TurnPolicy, got {type(self.policy).__name__}")

    @property
    def engine(self) -> EngineConfig:
        """The engine's settings."""
        return EngineConfig(self.max_batch, self.max_batch_kv_bytes, self.prefill_chunk, self.max_queue)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may use: the served model first."""
        return (self.model, *(n for n in self.served_names if n != self.model))
