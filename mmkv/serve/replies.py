"""From the worker's events to OpenAI objects: one ``ChatCompletion``, or a stream of ``ChatCompletionChunk`` s.

Both go through one ``Reply``: every decoded token's text goes into a ``ToolCallStream`` (which splits content
from tool calls) and its logprob into the pending list; a whole answer is the same pieces joined, so a streamed
answer and a whole one agree by construction. A stream sends, in order: the role, content deltas, per tool
call its index, id and name then its argument fragments (as OpenAI streams them), a last chunk with the
``finish_reason`` ("tool_calls" when the answer made calls), the usage chunk when asked, then ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid

from ..runtime import Answer, DecodeStep, TokenLogprob
from ..toolcalls import ArgumentsPiece, CallStart, ContentPiece, ToolCallStream
from .protocol import (
    AssistantOut,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionTokenLogprob,
    Choice,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    FunctionCallOut,
    FunctionDelta,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)

__all__ = ["Reply", "extension", "usage"]


def usage(answer: Answer) -> Usage:
    """The usage object; ``cached_tokens``: prompt tokens whose KV was not recomputed (live prefix or stores)."""
    stats = answer.prefill
    completion = len(answer.token_ids)
    return Usage(
        prompt_tokens=stats.prompt_tokens, completion_tokens=completion, total_tokens=stats.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.reused),
    )  # fmt: skip


def extension(answer: Answer) -> dict:
    """The ``mmkv`` object of a response: where each image came from, and what the turn took."""
    stats = answer.prefill
    images = [
        {"index": r.index, "source": r.source, "encoder": r.encoder, "digest": r.digest} for r in stats.images
    ]
    return {
        "images": images, "prefilled_tokens": stats.prefilled, "reused_tokens": stats.reused,
        "ttft_ms": round(1e3 * answer.ttft_s, 3), "queue_ms": round(1e3 * answer.queue_s, 3),
    }  # fmt: skip


def _logprob(entry: TokenLogprob) -> ChatCompletionTokenLogprob:
    top = [TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.bytes)) for t in entry.top]
    return ChatCompletionTokenLogprob(
        token=entry.token, logprob=entry.logprob, bytes=list(entry.bytes), top_logprobs=top
    )


class Reply:
    """One request's answer as OpenAI objects (see the module docstring)."""

    def __init__(
        self, model: str, read_tool_calls: bool, calls_trusted: bool, logprobs: bool, end_of_turn: int
    ):
        self.model, self.logprobs, self.end_of_turn = model, logprobs, end_of_turn
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.calls = ToolCallStream(calls_trusted) if read_tool_calls else None
        self.content: list[str] = []
        self.tool_calls: list[list[str]] = []  # per call: id, name, arguments
        self._logprobs: list[ChatCompletionTokenLogprob] = []  # not yet sent
        self._all_logprobs: list[ChatCompletionTokenLogprob] = []

    # ------------------------------------------------------------------------------------------- the pieces
    def take(self, step: DecodeStep) -> ChoiceDelta | None:
        """One decoded token: the delta it makes certain (None when nothing)."""
        if step.logprob is not None and step.token != self.end_of_turn:
            entry = _logprob(step.logprob)
            self._logprobs.append(entry)
            self._all_logprobs.append(entry)
        return self._delta(step.delta)

    def close(self, answer: Answer) -> ChoiceDelta | None:
        """The answer ended: what is left."""
        return self._delta(None)

    def _delta(self, text: str | None) -> ChoiceDelta | None:
        if self.calls is None:
            pieces = [ContentPiece(text)] if text else []
        else:
            pieces = self.calls.feed(text) if text is not None else self.calls.finish()
        content, calls = [], []
        for piece in pieces:
            if isinstance(piece, ContentPiece):
                content.append(piece.text)
                self.content.append(piece.text)
            elif isinstance(piece, CallStart):
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                self.tool_calls.append([call_id, piece.name, ""])
                calls.append(ToolCallDelta(index=piece.index, id=call_id, type="function",
                                           function=FunctionDelta(name=piece.name, arguments="")))  # fmt: skip
            elif isinstance(piece, ArgumentsPiece):
                self.tool_calls[piece.index][2] += piece.text
                calls.append(ToolCallDelta(index=piece.index, function=FunctionDelta(arguments=piece.text)))
        if not content and not calls:
            return None
        return ChoiceDelta(content="".join(content) or None, tool_calls=calls or None)

    def finish_reason(self, answer: Answer) -> str:
        """ "tool_calls" when the answer made calls, else the decoder's ("stop" / "length")."""
        return "tool_calls" if self.tool_calls and answer.finish_reason == "stop" else answer.finish_reason

    # ------------------------------------------------------------------------------------------- a whole one
    def completion(self, answer: Answer) -> ChatCompletion:
        """The whole answer (every token already ``take`` n, then ``close`` d)."""
        calls = [
            ToolCallOut(id=i, function=FunctionCallOut(name=n, arguments=a)) for i, n, a in self.tool_calls
        ]
        message = AssistantOut(content="".join(self.content) or None, tool_calls=calls or None)
        logprobs = ChoiceLogprobs(content=self._all_logprobs) if self.logprobs else None
        choice = Choice(message=message, finish_reason=self.finish_reason(answer), logprobs=logprobs)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=usage(answer), mmkv=extension(answer))  # fmt: skip

    # ------------------------------------------------------------------------------------------- a stream
    def chunk(self, delta: ChoiceDelta, finish: str | None = None, force: bool = False) -> str | None:
        """One SSE event for ``delta`` with the pending logprobs (None when there is nothing to send)."""
        has_delta = delta.role or delta.content is not None or delta.tool_calls
        if not has_delta and not self._logprobs and finish is None and not force:
            return None
        logprobs = ChoiceLogprobs(content=self._logprobs) if self.logprobs and self._logprobs else None
        self._logprobs = []
        choice = ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        return _event(chunk)

    def usage_chunk(self, answer: Answer) -> str:
        """The last chunk a stream sends with ``stream_options.include_usage`` (no choices)."""
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                    usage=usage(answer), mmkv=extension(answer))  # fmt: skip
        return _event(chunk)


def _event(chunk: ChatCompletionChunk) -> str:
    body = chunk.model_dump(exclude_none=True)
    for choice in body["choices"]:  # OpenAI sends these two keys even when null
        choice.setdefault("finish_reason", None)
        choice.setdefault("logprobs", None)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
