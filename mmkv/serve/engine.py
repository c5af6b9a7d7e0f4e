"""``Engine``: what one server holds (the model, its stores, the pool of live caches, the model worker, the
metrics), and the translation between OpenAI requests and mmkv's records.

A request's messages become a ``Conversation`` exactly as a ``Session`` would hold them (one message per
request message; text parts as text items; image parts, user messages only, decoded, keyed and preprocessed
here, before the request queues), so the server's prompt is the one ``Session.ask`` renders for the same
conversation.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import mmkv

from ..cache import EncoderStore, KVStore
from ..cache.memory import MemoryTier
from ..conversation import Conversation, ConversationImage
from ..runtime import Answer, prepare_image
from .config import ServerConfig
from .media import MediaError, MediaPolicy, read_image_url
from .metrics import Metrics
from .pool import LivePool
from .schema import ChatCompletionRequest, ImagePart
from .worker import Worker

__all__ = ["Engine"]


class Engine:
    """The model and everything a server shares between requests."""

    def __init__(self, config: ServerConfig, handle: mmkv.ModelHandle | None = None) -> None:
        """Load the model (or take ``handle``) and open the stores; raises ``mmkv.MmkvError`` (e.g.
        ``ModelNotFoundError``, ``StoreUnavailableError``) when they cannot be."""
        self.config = config
        self.handle = handle or mmkv.load(config.model, device=config.device)
        self.kv_store, self.encoder_store = _stores(config.stores)
        self.pixels = MemoryTier(256 << 20)  # preprocessed images by digest
        self.decoded: MemoryTier[ConversationImage] = MemoryTier(
            256 << 20
        )  # image records by hash of the bytes
        self.pool = LivePool(self.handle, config.pool_bytes)
        self.metrics = Metrics()
        self.media = MediaPolicy(
            config.allowed_media_domains, config.allowed_local_media_path, config.max_image_bytes,
            config.fetch_timeout_s,
        )  # fmt: skip
        self.worker = Worker(self.handle, self.kv_store, self.encoder_store, self.pixels, self.pool,
                             self.metrics, config.max_queue)  # fmt: skip
        self.started = time.time()

    def conversation(self, body: ChatCompletionRequest) -> Conversation:
        """The request's messages as a ``Conversation`` (images fetched or decoded, keyed, preprocessed).
        Raises ``MediaError`` or an ``mmkv.MmkvError`` (text, role or image), changing nothing shared."""
        conversation, images = Conversation(), 0
        for message in body.messages:
            parts = message.content
            if parts is None or isinstance(parts, str):
                conversation.add_text(parts or "", message.role, new_message=True)
                continue
            for number, part in enumerate(parts):
                first = number == 0
                if not isinstance(part, ImagePart):
                    conversation.add_text(part.text, message.role, new_message=first)
                    continue
                if message.role != "user":
                    raise MediaError(
                        f"images are accepted in user messages only, not in a {message.role} message"
                    )
                images += 1
                if images > self.config.max_images:
                    raise MediaError(f"a request holds at most {self.config.max_images} images", 413)
                data = read_image_url(part.image_url.url, self.media)
                record = self._image(data)
                conversation.add_image(record, message.role, new_message=first)
        return conversation

    def _image(self, data: bytes) -> ConversationImage:
        """The image record of encoded ``data``: agents resend the same screenshots every turn, so records are
        kept by a hash of the bytes (bounded LRU) and a resent image is neither decoded nor hashed again."""
        key = hashlib.sha256(data).hexdigest()
        record = self.decoded.get(key)
        if record is None:
            record = prepare_image(self.handle, data, self.config.max_image_pixels, self.config.policy.reuse,
                                   self.encoder_store, self.pixels)  # fmt: skip
            self.decoded.put(key, record, 3 * record.pixels.width * record.pixels.height + len(data))
        return record  # (preprocessed pixels evicted since are made again by the turn that needs them)

    def usage(self, completion: Answer) -> dict:
        """The OpenAI usage object; ``cached_tokens`` = prompt tokens whose KV was not recomputed."""
        stats = completion.prefill
        return {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": len(completion.token_ids),
            "total_tokens": stats.prompt_tokens + len(completion.token_ids),
            "prompt_tokens_details": {"cached_tokens": stats.reused},
        }

    def extension(self, completion: Answer) -> dict:
        """The ``mmkv`` object of a response: where each image came from, and what the turn took."""
        stats = completion.prefill
        images = [
            {"index": r.index, "source": r.source, "encoder": r.encoder, "digest": r.digest}
            for r in stats.images
        ]
        return {
            "images": images,
            "prefilled_tokens": stats.prefilled,
            "reused_tokens": stats.reused,
            "ttft_ms": round(1e3 * completion.ttft_s, 3),
            "queue_ms": round(1e3 * completion.queue_s, 3),
        }

    def record(self, completion: Answer) -> None:
        """Count a finished request in the metrics."""
        m, stats = self.metrics, completion.prefill
        m.ttft.observe(completion.ttft_s)
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.cached_tokens.inc(stats.reused)
        m.prefilled_tokens.inc(stats.prefilled)
        m.completion_tokens.inc(len(completion.token_ids))
        for image in stats.images:
            m.image_sources.labels(image.source).inc()

    def close(self) -> None:
        self.worker.close()


def _stores(tiers: tuple[str, ...]) -> tuple[KVStore, EncoderStore]:
    """The KV and encoder stores over the configured tiers, in order (memory only when none): a directory
    holds image KV, and vision outputs in its ``encoder`` subdirectory; a Redis URL holds both (keys differ)."""
    encoder_tiers = [t if "://" in t else str(Path(t).expanduser() / "encoder") for t in tiers]
    return KVStore(path=list(tiers)), EncoderStore(path=encoder_tiers)
