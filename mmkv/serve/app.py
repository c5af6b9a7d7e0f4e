"""The OpenAI-compatible HTTP front end: thin FastAPI routes over one ``Engine``.

A chat request's path: the body is read within its bound and validated (``protocol``: unknown fields and
refused ones are 400s naming them) -> its images are fetched or decoded and the ``Conversation`` built, off the
event loop (``Engine.intake``; its schemas checked first) -> its grammar compiled on a worker thread (tools,
response format; ``Engine.constraint``) -> it queues for the one model
worker (503 when the queue is full) -> the worker's events become one ``ChatCompletion`` or a stream of chunks
(``replies.Reply``). Every refusal is an OpenAI error object whose status follows the exception's type
(``engine.as_api_error``); unknown routes and methods are error objects too; a failure after a stream started is
its last ``data: {"error": ...}`` event. One log line per request (``mmkv.serve``: id, status, tokens, TTFT,
image sources); a bug is logged with its traceback under the request id and answered with a 500 that says only
that. ``/v1/responses`` (the Responses API) is not served: a 404 error object says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import QueueFull
from ..engine.events import Delta, Done, Failed, First
from ..errors import MmkvError
from .engine import Engine, as_api_error
from .media import MediaError
from .protocol import (
    ApiError,
    BadRequest,
    Busy,
    ChatCompletionRequest,
    ChoiceDelta,
    InternalError,
    MethodNotAllowed,
    NotFound,
    RequestTimeout,
    Timeout,
    TooLarge,
    Unauthorized,
    error_from_validation,
)
from .replies import Reply
from .worker import Job

__all__ = ["create_app"]

log = logging.getLogger("mmkv.serve")
MAX_JSON_DEPTH = 64  # request JSON nested deeper than this is refused before parsing
# a body holding more objects and arrays than this (a schema of thousands of nodes; an agent's turn holds a few
# hundred) is taken in one at a time per server (parsed, checked, laid out), waiting without a thread: tens of such
# bodies at once would otherwise hold the interpreter and starve the model thread and every other request
HEAVY_BODY_BRACKETS = 4096
DISCONNECT_CHECK_S = 0.25  # how often a waiting request looks whether its client is still there


def create_app(engine: Engine) -> FastAPI:
    """The ASGI app serving ``engine`` (its model already loaded)."""
    config, metrics = engine.config, engine.metrics
    app = FastAPI(title="mmkv", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.heavy_bodies = asyncio.Semaphore(1)  # the one turn at parsing a HEAVY_BODY_BRACKETS body

    def respond(error: ApiError, request_id: str) -> JSONResponse:
        metrics.requests.labels(str(error.status)).inc()
        log.info("%s status=%d error=%s", request_id, error.status, error.message[:200])
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown routes, methods
        if exc.status_code == 405:
            error: ApiError = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
        elif exc.status_code == 404:
            error = NotFound(
                f"no route {request.url.path} (this server serves /v1/chat/completions, /v1/models)"
            )
        else:
            error = BadRequest(str(exc.detail))
            error.status = exc.status_code
        return respond(error, "-")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: logged, never echoed
        request_id = getattr(request.state, "request_id", "-")
        log.error("%s internal error", request_id, exc_info=exc)
        return respond(InternalError(f"internal error (request {request_id})"), request_id)

    @app.get("/health")
    async def health(request: Request):
        if not config.open_health and (error := _auth(request, config.api_key)) is not None:
            return respond(error, "-")
        state = {"status": "draining" if engine.drain.draining else "ok", "model": config.model,
                 "queue": engine.worker.num_waiting, "running": engine.worker.num_running}  # fmt: skip
        return JSONResponse(state, 503, headers={"Retry-After": "1"}) if engine.drain.draining else state

    @app.get("/v1/models")
    async def models(request: Request):
        if (error := _auth(request, config.api_key)) is not None:
            return respond(error, "-")
        created = int(engine.started)
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "mmkv"}
                                            for n in config.names]}  # fmt: skip

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if not config.open_metrics and (error := _auth(request, config.api_key)) is not None:
            return respond(error, "-")
        metrics.pool_entries.set(engine.pool.num_entries)
        metrics.pool_bytes.set(engine.pool.num_bytes)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/responses", methods=["GET", "POST"])
    async def responses():
        return respond(
            NotFound("the Responses API (/v1/responses) is not served; use /v1/chat/completions"), "-"
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        request_id = request.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        deadline = time.monotonic() + config.request_timeout_s  # one deadline, from the request's arrival
        if not engine.drain.admit():
            return respond(Busy("the server is draining (shutting down); send the request to another replica",
                                code="draining"), request_id)  # fmt: skip
        try:
            return await _chat(request, request_id, deadline)
        finally:
            engine.drain.release()

    async def _chat(request: Request, request_id: str, deadline: float):
        async with contextlib.AsyncExitStack() as held:  # a heavy body's turn, held until its job is built
            try:
                body = await _checked_request(request, engine, deadline, held)
                fetched = await engine.fetch(body, deadline)  # http(s) images, on the media pool
                intake = await run_in_threadpool(engine.intake, body, fetched, deadline)
                constraint = await engine.constraint(intake.grammar, deadline)  # on a worker thread
                loop = asyncio.get_running_loop()
                job = await run_in_threadpool(engine.prepare, body, intake, constraint, deadline, loop)
            except (ApiError, MediaError, MmkvError, ValueError) as exc:
                return respond(as_api_error(exc), request_id)
        try:
            engine.worker.submit(job.request)
        except QueueFull:
            return respond(
                Busy(f"the server is busy ({config.max_queue} requests waiting); retry shortly"), request_id
            )
        reply = Reply(
            body.model, intake.read_tool_calls, intake.calls_trusted, body.logprobs, engine.end_of_turn
        )
        reply.id = request_id
        context = (request, engine, job, reply, intake.url_schemes)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            metrics.requests.labels("200").inc()
            return StreamingResponse(_stream(*context, include_usage), media_type="text/event-stream")
        return await _whole(*context, respond)

    return app


def _auth(request: Request, api_key: str | None) -> ApiError | None:
    if api_key is None or request.headers.get("authorization", "") == f"Bearer {api_key}":
        return None
    return Unauthorized("a valid API key is required (Authorization: Bearer <key>)")


async def _checked_request(
    request: Request, engine: Engine, deadline: float, held: contextlib.AsyncExitStack
) -> ChatCompletionRequest:
    """The request's body, read within its size and time bounds (``body_timeout_s``: 408; the request's
    ``deadline``: 504) and validated; raises ``ApiError``. A heavy body (over ``HEAVY_BODY_BRACKETS``) first
    takes the server's one turn at heavy bodies, entered into ``held``: the caller keeps it through the intake,
    the schema checks and the layout, so that such requests run one at a time and leave the interpreter to the
    model thread and the light requests."""
    config = engine.config
    if (error := _auth(request, config.api_key)) is not None:
        raise error
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
        raise TooLarge(f"the request body is over the bound of {config.max_body_bytes:,} bytes")
    data, chunks = bytearray(), request.stream().__aiter__()
    body_deadline = min(time.monotonic() + config.body_timeout_s, deadline)
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, body_deadline - time.monotonic()))
        except StopAsyncIteration:
            break
        except TimeoutError:
            if body_deadline < deadline:
                raise RequestTimeout(
                    f"the request body did not arrive within {config.body_timeout_s:g} s"
                ) from None
            raise Timeout("the request timed out while its body arrived") from None
        data += chunk
        if len(data) > config.max_body_bytes:
            raise TooLarge(f"the request body is over the bound of {config.max_body_bytes:,} bytes")
    data = bytes(data)
    depth, brackets = await run_in_threadpool(_shape, data)  # input-sized: never on the loop
    if depth > MAX_JSON_DEPTH:
        raise BadRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
    if brackets > HEAVY_BODY_BRACKETS:
        await held.enter_async_context(_turn(request.app.state.heavy_bodies, deadline))
    return await run_in_threadpool(_parsed, data, config.names)


@contextlib.asynccontextmanager
async def _turn(semaphore: asyncio.Semaphore, deadline: float):
    """Hold ``semaphore`` (waiting on the loop, no thread held) until ``deadline`` at most: ``Timeout`` then."""
    try:
        await asyncio.wait_for(semaphore.acquire(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise Timeout("the request timed out while its body waited for other large JSON bodies") from None
    try:
        yield
    finally:
        semaphore.release()


def _parsed(data: bytes, names: tuple[str, ...]) -> ChatCompletionRequest:
    """The body's JSON (its depth checked by ``_shape``), parsed and validated as a chat request for one of
    ``names``; raises ``ApiError``. Work in the body's size (megabytes of it take tens of milliseconds): it runs
    on a worker thread, so the event loop keeps answering other requests and ``/health``."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(raw, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        body = ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise error_from_validation(exc) from None
    if (refused := body.refused()) is not None:
        raise BadRequest(
            f"{refused[0]} is not supported by this server: {refused[1]}", refused[0], "unsupported_parameter"
        )
    if body.model not in names:
        error = NotFound(f"the model {body.model!r} does not exist; this server serves {list(names)}", "model")
        error.code = "model_not_found"
        raise error
    return body


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included (unrolled)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _shape(data: bytes | bytearray) -> tuple[int, int]:
    """``(depth, brackets)`` of JSON text: the deepest nesting of brackets and how many opening brackets (objects
    and arrays) it holds, strings skipped, counted without parsing and without a Python loop: the strings are
    cut out by one regular-expression pass, every byte but a bracket deleted, and the depth is the running sum's
    maximum (numpy), so a 20 MiB image URL or 300 KB of nested schema costs milliseconds, not a per-bracket walk
    holding the interpreter.

    >>> _shape(b'{"a": [1, {"b": "]]]"}]}'), _shape(b'[]'), _shape(b'"x"'), _shape(b'][[')
    ((3, 3), (1, 1), (0, 0), (1, 2))
    """
    brackets = np.frombuffer(_STRING.sub(b"", bytes(data)).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    opening = (brackets == ord("[")) | (brackets == ord("{"))  # (num_brackets,)
    return int(np.cumsum(np.where(opening, 1, -1)).max(initial=0)), int(opening.sum())


def _depth(data: bytes | bytearray) -> int:
    """The deepest nesting of brackets in JSON text (``_shape``'s first half)."""
    return _shape(data)[0]


async def _next_event(request: Request, engine: Engine, job: Job):
    """The job's next event; withdraws the job when the client disconnects (None) or the deadline passes (a
    ``Failed`` holding a ``TimeoutError``). The client is looked at every ``DISCONNECT_CHECK_S`` whether or not
    events arrive (a non-streamed answer being decoded sends nothing to notice a departure by)."""
    while True:
        now = time.monotonic()
        if now > job.deadline:
            engine.worker.withdraw(job.request)
            return Failed(TimeoutError("the request timed out"))
        if now - job.checked >= DISCONNECT_CHECK_S:
            job.checked = now
            if await request.is_disconnected():
                engine.worker.withdraw(job.request)
                return None
        if not job.events.empty():
            return job.events.get_nowait()
        try:
            return await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_CHECK_S)
        except TimeoutError:
            continue


def _failure(error: BaseException, request_id: str) -> ApiError:
    """The error object a failed job answers with, by type: the deadline 504, an ``mmkv.MmkvError`` (a prompt past
    the model's positions, ...) its refusal; anything else is a bug: logged with its traceback, a bare 500."""
    if isinstance(error, TimeoutError):
        return Timeout("the request timed out")
    if isinstance(error, (ApiError, MmkvError, MediaError)):
        return as_api_error(error)
    log.error("%s internal error", request_id, exc_info=error)
    return InternalError(f"internal error (request {request_id})")


def _log(request_id: str, status: int, answer, schemes) -> None:
    stats = answer.prefill
    images = (
        ",".join(f"{scheme}:{image.source}" for scheme, image in zip(schemes, stats.images, strict=False))
        or "-"
    )
    log.info("%s status=%d prompt=%d cached=%d completion=%d ttft_ms=%.1f images=%s", request_id, status,
             stats.prompt_tokens, stats.reused, len(answer.token_ids), 1e3 * answer.ttft_s, images)  # fmt: skip


async def _whole(request, engine, job, reply, schemes, respond):
    while True:
        event = await _next_event(request, engine, job)
        if event is None:
            return JSONResponse({"error": {"message": "the client went away", "type": "cancelled"}}, 499)
        if isinstance(event, Failed):
            return respond(_failure(event.error, reply.id), reply.id)
        if isinstance(event, Delta):
            reply.take(event.step)
        elif isinstance(event, Done):
            reply.close(event.answer)
            engine.count_answer(event.answer)
            engine.metrics.requests.labels("200").inc()
            _log(reply.id, 200, event.answer, schemes)
            return JSONResponse(reply.completion(event.answer).model_dump(mode="json"))


async def _stream(request, engine, job, reply, schemes, include_usage):
    started = False
    try:
        while True:
            event = await _next_event(request, engine, job)
            if event is None:
                return
            if isinstance(event, Failed):
                error = _failure(event.error, reply.id)
                yield f"data: {json.dumps(error.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            if isinstance(event, (First, Delta)) and not started:
                started = True
                yield reply.chunk(ChoiceDelta(role="assistant", content=""), force=True)
            if isinstance(event, Delta):
                if (chunk := reply.chunk(reply.take(event.step) or ChoiceDelta())) is not None:
                    yield chunk
            elif isinstance(event, Done):
                answer = event.answer
                if (chunk := reply.chunk(reply.close(answer) or ChoiceDelta())) is not None:
                    yield chunk
                engine.count_answer(answer)
                yield reply.chunk(ChoiceDelta(), reply.finish_reason(answer))
                if include_usage:
                    yield reply.usage_chunk(answer)
                yield "data: [DONE]\n\n"
                _log(reply.id, 200, answer, schemes)
                return
    finally:
        job.request.cancel()  # the client stopped reading: stop decoding (harmless once done)
