"""The OpenAI-compatible HTTP front end: FastAPI routes over one model ``Worker``.

``create_app(config)`` loads the model and its stores and returns the ASGI app; ``mmkv serve`` runs it under
uvicorn. Each request is checked (key, size, schema, model, parameters, images) before it queues, so a bad one
costs no model time and gets its OpenAI error object at once: 400 invalid request or image, 401 wrong key, 404
unknown model, 413 body or image over the bound, 422 schema, 503 with ``Retry-After`` when the queue is full,
504 past the request timeout. Nothing a client sends reaches a 500: the handlers turn every error into one of
these, and an error after a stream started becomes the stream's last ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..errors import MmkvError
from ..runtime import DecodeOptions, Sampling
from .engine import Engine
from .media import MediaError
from .schema import ChatCompletionRequest, error_body, validation_message
from .worker import Delta, Done, Failed, First, Job, QueueFull

__all__ = ["ApiError", "create_app"]


class ApiError(Exception):
    """A refusal with its HTTP status and OpenAI error type."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(error_body(self.message, self.kind, self.param), self.status, headers=headers)


def create_app(engine: Engine) -> FastAPI:
    """The ASGI app serving ``engine`` (its model already loaded)."""
    config, metrics = engine.config, engine.metrics
    app = FastAPI(title="mmkv", version=__version__, docs_url=None, redoc_url=None)
    app.state.engine = engine

    def finish(response: Response) -> Response:
        metrics.requests.labels(str(response.status_code)).inc()
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug; still an error object
        return finish(JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": config.model, "queue": len(engine.worker.queue)}

    @app.get("/v1/models")
    async def models(request: Request):
        if (error := _auth(request, config.api_key)) is not None:
            return finish(error.response())
        created = int(engine.started)
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "mmkv"} for name in config.names
        ]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.pool_entries.set(engine.pool.num_entries)
        metrics.pool_bytes.set(engine.pool.num_bytes)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = await _checked_request(request, engine)
            conversation = await run_in_threadpool(engine.conversation, body)
        except ApiError as error:
            return finish(error.response())
        except MediaError as error:
            return finish(ApiError(error.status, str(error), param="messages").response())
        except (MmkvError, ValueError, TypeError) as error:  # bad text, role or image: the caller's to fix
            status = 413 if "over the bound" in str(error) else 400
            return finish(ApiError(status, str(error), param="messages").response())
        options = body.mmkv
        overrides = {} if options is None else options.model_dump(exclude_none=True)
        policy = replace(config.policy, **overrides)  # the server's policy, with this request's overrides
        limit = min(body.token_limit or config.max_tokens, config.max_tokens)
        sampling = Sampling(body.temperature, body.top_p, body.seed) if body.temperature > 0 else Sampling()
        loop = asyncio.get_running_loop()
        options = DecodeOptions(limit, sampling, tuple(body.stop or ()))
        job = Job(
            conversation, policy, options, loop, asyncio.Queue(), time.monotonic() + config.request_timeout_s
        )
        try:
            engine.worker.submit(job)
        except QueueFull:
            message = f"the server is busy ({config.max_queue} requests waiting); retry shortly"
            return finish(ApiError(503, message, "server_busy").response())
        reply = _Reply(body.model, job)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            metrics.requests.labels("200").inc()
            return StreamingResponse(
                reply.stream(request, engine, include_usage), media_type="text/event-stream"
            )
        return finish(await reply.whole(request, engine))

    return app


def _auth(request: Request, api_key: str | None) -> ApiError | None:
    if api_key is None:
        return None
    if request.headers.get("authorization", "") != f"Bearer {api_key}":
        return ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "invalid_api_key")
    return None


async def _checked_request(request: Request, engine: Engine) -> ChatCompletionRequest:
    """The request's body, read within the size bound and validated; raises ``ApiError``."""
    config = engine.config
    if (error := _auth(request, config.api_key)) is not None:
        raise error
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
        raise ApiError(413, f"the request body is over the bound of {config.max_body_bytes:,} bytes")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > config.max_body_bytes:
            raise ApiError(413, f"the request body is over the bound of {config.max_body_bytes:,} bytes")
    try:
        raw = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    try:
        body = ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(422, message, param=param) from None
    if body.model not in config.names:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {list(config.names)}",
                       "model_not_found", "model")  # fmt: skip
    if body.n != 1:
        raise ApiError(400, "n must be 1 (one answer per request)", param="n")
    if (body.token_limit or 0) > config.max_tokens:
        raise ApiError(
            400, f"max_tokens is over this server's bound of {config.max_tokens}", param="max_tokens"
        )
    return body


class _Reply:
    """Turns a job's events into one response or a stream of chunks."""

    def __init__(self, model: str, job: Job) -> None:
        self.model, self.job = model, job
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    async def _event(self, request: Request, engine: Engine):
        """The next event; cancels the job when the client disconnects or the deadline passes (then a
        ``Failed`` with ``TimeoutError``, or None for a client gone)."""
        while True:
            try:
                return await asyncio.wait_for(self.job.events.get(), timeout=0.25)
            except TimeoutError:
                if time.monotonic() > self.job.deadline:
                    engine.worker.withdraw(self.job)
                    return Failed(TimeoutError("the request timed out"))
                if await request.is_disconnected():
                    engine.worker.withdraw(self.job)
                    return None

    async def whole(self, request: Request, engine: Engine) -> JSONResponse:
        while True:
            event = await self._event(request, engine)
            if event is None:
                return JSONResponse(error_body("the client went away", "cancelled"), 499)
            if isinstance(event, Failed):
                return _failure(event.error).response()
            if isinstance(event, Done):
                answer = event.answer
                engine.record(answer)
                message = {"role": "assistant", "content": answer.text}
                choice = {
                    "index": 0,
                    "message": message,
                    "finish_reason": answer.finish_reason,
                    "logprobs": None,
                }
                body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                        "choices": [choice], "usage": engine.usage(answer), "mmkv": engine.extension(answer)}  # fmt: skip
                return JSONResponse(body)

    def _chunk(self, delta: dict, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [choice]}  # fmt: skip
        return f"data: {json.dumps(chunk)}\n\n"

    async def stream(self, request: Request, engine: Engine, include_usage: bool):
        sent_role = False
        try:
            while True:
                event = await self._event(request, engine)
                if event is None:
                    return
                if isinstance(event, Failed):
                    error = _failure(event.error)
                    yield f"data: {json.dumps(error_body(error.message, error.kind))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if isinstance(event, (First, Delta)) and not sent_role:
                    sent_role = True
                    yield self._chunk({"role": "assistant", "content": ""})
                if isinstance(event, Delta) and event.step.delta:
                    yield self._chunk({"content": event.step.delta})
                if isinstance(event, Done):
                    answer = event.answer
                    engine.record(answer)
                    yield self._chunk({}, answer.finish_reason)
                    if include_usage:
                        usage = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.model, "choices": [], "usage": engine.usage(answer),
                                 "mmkv": engine.extension(answer)}  # fmt: skip
                        yield f"data: {json.dumps(usage)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            self.job.cancelled.set()  # the client stopped reading: stop decoding (harmless once done)


def _failure(error: BaseException) -> ApiError:
    """The error object a failed job answers with, chosen by the exception's type."""
    if isinstance(error, TimeoutError):
        return ApiError(504, "the request timed out", "timeout")
    if isinstance(error, MmkvError):
        return ApiError(400, str(error))
    return ApiError(500, f"internal error: {type(error).__name__}", "server_error")
