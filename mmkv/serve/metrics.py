"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own (several servers in one process,
as in the tests, do not share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters, histograms and gauges of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mmkv_requests", "Chat completion requests by HTTP status", ["status"], registry=r
        )
        self.ttft = Histogram(
            "mmkv_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "mmkv_queue_wait_seconds",
            "Time a request waited for the model",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("mmkv_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "mmkv_cached_tokens", "Prompt tokens whose KV was not recomputed", registry=r
        )
        self.prefilled_tokens = Counter(
            "mmkv_prefilled_tokens", "Prompt tokens run through the model", registry=r
        )
        self.completion_tokens = Counter("mmkv_completion_tokens", "Generated tokens", registry=r)
        self.image_sources = Counter(
            "mmkv_image_sources", "Images by where their KV came from", ["tier"], registry=r
        )
        self.pool_entries = Gauge("mmkv_pool_entries", "Idle live caches kept between requests", registry=r)
        self.pool_bytes = Gauge("mmkv_pool_bytes", "KV bytes of the idle live caches", registry=r)
        self.queue_depth = Gauge("mmkv_queue_depth", "Requests waiting for the model", registry=r)
        self.decode_rows = Histogram(
            "mmkv_decode_batch_rows", "Sequences decoded per batched forward", buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.running = Gauge("mmkv_running_requests", "Requests prefilling or decoding (the batch)", registry=r)
