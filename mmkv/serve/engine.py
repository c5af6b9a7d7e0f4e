"""``Engine``: what one server holds (the model, its stores, the pool of live caches, the model worker, the
metrics) and the two translations a request needs: its body into an ``Intake`` (``mmkv.serve.intake``: images
fetched or decoded, keyed and preprocessed before the request queues) and its grammar into a constraint.

A request's messages become a ``Conversation`` exactly as a ``Session`` would hold them, so the server's prompt
is the one ``Session.ask`` renders for the same conversation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import mmkv

from ..cache import EncoderStore, KVStore
from ..cache.memory import MemoryTier
from ..engine import Request
from ..errors import GrammarError, ImageTooLargeError, MmkvError, PromptTooLongError
from ..images import load_image
from ..messages import ConversationImage
from ..prompt.blocks import LayoutBuilder
from ..runtime import Answer, check_positions, prepare_image
from ..runtime.decode import end_of_turn_id
from ..runtime.grammar import GrammarSpec, TokenConstraint, constraint_for, set_cache_bytes, vocabulary_of
from .budget import ByteBudget, decode_bytes
from .config import ServerConfig
from .drain import Drain
from .intake import Intake, bytes_key, low_detail, read_request
from .media import MediaError, MediaPolicy, read_image_url, read_image_url_async
from .metrics import Metrics
from .pool import LivePool
from .protocol import ApiError, BadRequest, ChatCompletionRequest, ImagePart, Timeout, TooLarge
from .worker import Job, Worker

__all__ = ["Engine", "as_api_error"]

log = logging.getLogger("mmkv.serve")


class Engine:
    """The model and everything a server shares between requests."""

    def __init__(self, config: ServerConfig, handle: mmkv.ModelHandle | None = None) -> None:
        """Load the model (or take ``handle``) and open the stores; raises ``mmkv.MmkvError`` (e.g.
        ``ModelNotFoundError``, ``StoreUnavailableError``) when they cannot be."""
        self.config = config
        self.handle = handle or mmkv.load(config.model, device=config.device)
        self.kv_store, self.encoder_store = _stores(
            config.stores, config.kv_memory_bytes, config.encoder_memory_bytes
        )
        self.vision_inputs = MemoryTier(config.image_cache_bytes)  # preprocessed images by digest
        self.decoded: MemoryTier[ConversationImage] = MemoryTier(config.image_cache_bytes)  # records by bytes
        self.decoding = ByteBudget(config.decode_budget_bytes)  # pixels decoded at once, all requests
        self.pool = LivePool(self.handle, config.pool_bytes)
        self.metrics = Metrics()
        self.media = MediaPolicy(
            config.allowed_media_domains, config.allowed_local_media_path, config.max_image_bytes,
            config.fetch_timeout_s, max_fetches=config.max_fetches,
        )  # fmt: skip
        self.layouts = LayoutBuilder(self.handle, config.layout_cache_bytes)  # one for all requests: by content
        self.worker = Worker(self.handle, self.kv_store, self.encoder_store, self.vision_inputs, self.pool,
                             self.metrics, config.engine)  # fmt: skip
        self._token_bytes = max(len(t) for t in self.handle.tokenizer.get_vocab())  # longest token, in bytes
        self.end_of_turn = end_of_turn_id(self.handle)
        vocabulary_of(self.handle)  # the grammar engine's view of the tokenizer, built now, not by a request
        set_cache_bytes(config.grammar_cache_bytes)  # (the grammar cache is the process's)
        self.drain = Drain()  # SIGTERM: refuse new requests, answer the ones held (``drain``)
        self.started = time.time()

    def busy(self) -> bool:
        """Whether the model worker holds a request (queued, prefilling or decoding)."""
        return bool(self.worker.num_waiting or self.worker.num_running)

    async def fetch(self, body: ChatCompletionRequest, deadline: float) -> dict[str, bytes]:
        """The bytes of every http(s) image URL in ``body``, fetched on the media pool without holding a thread
        of the event loop's, within ``deadline`` (``time.monotonic()``). Raises ``MediaError``."""
        urls = {part.image_url.url for message in body.messages if isinstance(message.content, list)
                for part in message.content if isinstance(part, ImagePart)}  # fmt: skip
        remote = sorted(u for u in urls if u.split(":", 1)[0].lower() in ("http", "https"))
        fetched = await asyncio.gather(*(read_image_url_async(u, self.media, deadline) for u in remote))
        return dict(zip(remote, fetched, strict=True))

    def intake(self, body: ChatCompletionRequest, fetched: dict[str, bytes], deadline: float) -> Intake:
        """The request as mmkv's records (see ``mmkv.serve.intake``), images from ``fetched`` (``fetch``) or
        decoded here (``data:``, ``file://``), all within ``deadline``. Raises an ``ApiError`` (text, roles,
        images, URLs, tools, formats; ``Timeout`` past the deadline), changing nothing shared but the image
        caches."""

        def read(url: str) -> bytes:
            if time.monotonic() > deadline:
                raise Timeout("the request timed out while its images were read")
            return fetched[url] if url in fetched else read_image_url(url, self.media, deadline)

        def decode_image(data: bytes, detail: str) -> ConversationImage:
            if time.monotonic() > deadline:
                raise Timeout("the request timed out while its images were decoded")
            return self._image(data, detail, deadline)

        try:
            return read_request(body, self.config.policy, self.config.max_tokens, self.config.max_images,
                                decode_image, read, self.config.max_schema_bytes, deadline)  # fmt: skip
        except GrammarError as exc:  # a schema or tool list: the param is the response format or the tools
            raise as_api_error(exc, "tools" if str(exc).startswith("tool") else "response_format") from exc
        except (ValueError, TypeError) as exc:  # the records' checks: text, roles, tool calls, field values
            raise as_api_error(exc, "messages") from exc

    def prepare(
        self, body: ChatCompletionRequest, intake: Intake, constraint: TokenConstraint | None, deadline: float,
        loop: asyncio.AbstractEventLoop,
    ) -> Job:  # fmt: skip
        """The request's ``Job``: its prompt laid out (messages rendered and tokenised: input-sized work, so on
        the request's own thread, never the model's or the event loop's) and its engine ``Request``. A prompt
        that cannot fit the model's positions is refused from its size first (``PromptTooLongError``), before
        anything is tokenised: no token is longer than the vocabulary's longest, so the text's bytes bound the
        tokens from below."""
        text_bytes = sum(len(text.encode("utf-8", "surrogatepass")) for text in _texts(body))
        if text_bytes // self._token_bytes > self.handle.max_positions:
            raise PromptTooLongError(
                f"the messages hold {text_bytes:,} bytes of text: at least {text_bytes // self._token_bytes:,} "
                f"tokens, past this model's {self.handle.max_positions} positions"
            )
        if time.monotonic() > deadline:
            raise Timeout("the request timed out before it was laid out")
        layout = self.layouts.build(intake.conversation, add_generation_prompt=True)
        check_positions(self.handle, layout)
        job = Job(loop, metrics=self.metrics)
        job.request = Request(layout, intake.conversation.images, intake.policy, intake.options, job.emit,
                              constraint, deadline)  # fmt: skip
        return job

    async def constraint(self, grammar: GrammarSpec | None, deadline: float) -> TokenConstraint | None:
        """A fresh constraint for one answer, or None. Compiled once per grammar, on a worker thread (a compile
        is input-sized: never on the event loop) in the one turn for heavy grammar work, within ``deadline``.
        Raises ``GrammarError`` (the engine refused it: a 400), ``Timeout`` past the deadline."""
        if grammar is None:
            return None
        work = asyncio.to_thread(constraint_for, self.handle, grammar, deadline)
        try:
            return await asyncio.wait_for(work, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise Timeout("the request timed out while its grammar compiled") from None

    def _image(self, data: bytes, detail: str = "auto", deadline: float | None = None) -> ConversationImage:
        """The image record of encoded ``data``: agents resend the same screenshots every turn, so records are
        kept by a hash of the bytes (bounded LRU) and a resent image is neither decoded nor hashed again.
        ``detail="low"``: shrunk to fit a 512x512 square first. Decoding waits for room in the decode budget
        (``decode_budget_bytes`` over every request), bounded by ``deadline``."""
        key = bytes_key(data, detail)
        record = self.decoded.get(key)
        if record is not None:
            return record  # (preprocessed pixels evicted since are made again by the turn that needs them)
        max_pixels = self.config.max_image_pixels
        with self.decoding.hold(decode_bytes(data, max_pixels), deadline):
            source = data if detail != "low" else low_detail(load_image(data, max_pixels=max_pixels))
            record = prepare_image(
                self.handle, source, max_pixels, self.config.policy, self.encoder_store, self.vision_inputs
            )
        self.decoded.put(key, record, 3 * record.pixels.width * record.pixels.height + len(data))
        return record

    def count_answer(self, answer: Answer) -> None:
        """Count a finished request in the metrics."""
        m, stats = self.metrics, answer.prefill
        m.ttft.observe(answer.ttft_s)
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.cached_tokens.inc(stats.reused)
        m.prefilled_tokens.inc(stats.prefilled)
        m.completion_tokens.inc(len(answer.token_ids))
        for image in stats.images:
            m.image_sources.labels(image.source).inc()

    def close(self) -> None:
        self.worker.close()
        self.media.close()


def _texts(body: ChatCompletionRequest) -> Iterator[str]:
    """Every text a request's messages carry (contents, text parts, tool-call names and arguments)."""
    for message in body.messages:
        content = getattr(message, "content", None)
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part.text for part in content if isinstance(getattr(part, "text", None), str))
        for call in getattr(message, "tool_calls", None) or ():
            yield call.function.name
            yield call.function.arguments


def as_api_error(error: BaseException, param: str | None = None) -> ApiError:
    """The refusal an exception stands for, chosen by its type: an ``ApiError`` itself; a media refusal with its
    status; an image over a bound 413; a deadline (``GrammarTimeoutError``: grammar work that waited too long)
    504; any other ``mmkv.MmkvError`` (a bad image, an unusable grammar, even one the engine stopped on
    mid-answer, a prompt past the model's positions) and a record's ``ValueError`` / ``TypeError`` 400."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, TimeoutError):
        return Timeout(str(error) or "the request timed out", param)
    if isinstance(error, MediaError):
        return {413: TooLarge, 504: Timeout}.get(error.status, BadRequest)(str(error), param)
    if isinstance(error, ImageTooLargeError):
        return TooLarge(str(error), param)
    if isinstance(error, (MmkvError, ValueError, TypeError)):
        return BadRequest(str(error), param)
    raise TypeError(f"not a refusal: {type(error).__name__}")


def _stores(tiers: tuple[str, ...], kv_bytes: int, encoder_bytes: int) -> tuple[KVStore, EncoderStore]:
    """The KV and encoder stores over the configured tiers, in order, their memory tiers bounded by the bytes
    given: a directory holds image KV, and vision outputs in its ``encoder`` subdirectory; a Redis URL holds
    both (keys differ)."""
    encoder_tiers = [t if "://" in t else str(Path(t).expanduser() / "encoder") for t in tiers]
    return KVStore(path=list(tiers), max_bytes=kv_bytes), EncoderStore(
        path=encoder_tiers, max_bytes=encoder_bytes
    )
