"""Reply, without a model: whatever the token split, a streamed answer's chunks joined are the whole answer
(content, each call's id, name and arguments, logprobs), the finish reason says "tool_calls" only for an
answer that ended with calls, the end-of-turn token has no logprob, and the usage counts what was reused."""

from __future__ import annotations

import json
import random

import pytest

from mmkv.runtime import Answer, DecodeStep, PrefillStats, TokenLogprob
from mmkv.runtime.plan import ImageReuse
from mmkv.serve.replies import Reply, extension, usage

EOT = 99
ANSWERS = [
    "Plain text, ünïcödé and all.",
    'Sure.\n<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": [2, 3]}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"s": "}"}}\n</tool_call>',
    "<tool_call>\nnot json\n</tool_call> then text",
]


def _steps(text: str, rng: random.Random) -> list[DecodeStep]:
    """``text`` cut at random points into token deltas, each with a logprob; then the end of turn."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    steps = []
    for i, piece in enumerate(pieces):
        top = (TokenLogprob(i + 1000, "t", (116,), -2.0),)
        steps.append(DecodeStep(i, piece, TokenLogprob(i, piece, tuple(piece.encode()), -0.5 * i, top)))
    return steps + [DecodeStep(EOT, "", TokenLogprob(EOT, "", (), -0.1))]


def _answer(steps, finish="stop") -> Answer:
    images = (ImageReuse(0, "d", "memory", None),)
    return Answer("", tuple(s.token for s in steps), finish, 0.0125, 0.5, PrefillStats(40, 10, 30, images))


def _streamed(reply: Reply, steps, answer) -> list[dict]:
    events = [reply.chunk(reply.take(step) or _empty()) for step in steps]
    events += [
        reply.chunk(reply.close(answer) or _empty()),
        reply.chunk(_empty(), reply.finish_reason(answer)),
    ]
    return [json.loads(e.removeprefix("data: ")) for e in events if e is not None]


def _empty():
    from mmkv.serve.protocol import ChoiceDelta

    return ChoiceDelta()


@pytest.mark.parametrize(
    ("text", "trusted"),
    [(text, trusted) for text in ANSWERS for trusted in (False, True) if not (trusted and "not json" in text)],
)  # a grammar never writes a malformed call: that answer is only read untrusted
def test_the_stream_joined_is_the_whole_answer_for_every_token_split(text, trusted):
    for seed in range(15):
        steps = _steps(text, random.Random(seed))
        answer = _answer(steps)
        whole_reply, stream_reply = (Reply("m", True, trusted, True, EOT) for _ in range(2))
        for step in steps:
            whole_reply.take(step)
        whole_reply.close(answer)
        whole = whole_reply.completion(answer).model_dump()["choices"][0]
        chunks = _streamed(stream_reply, steps, answer)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        content = "".join(d.get("content") or "" for d in deltas)
        calls: dict[int, list[str]] = {}
        for d in deltas:
            for call in d.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], ["", "", ""])
                entry[0] += call.get("id") or ""
                entry[1] += call["function"].get("name") or ""
                entry[2] += call["function"].get("arguments") or ""
        message = whole["message"]
        assert content == (message["content"] or "")
        streamed = [calls[i] for i in sorted(calls)]
        assert [c[1:] for c in streamed] == [
            [c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"] or ()
        ]  # each reply draws its own ids: the calls agree in name and arguments
        assert all(c[0].startswith("call_") and len(c[0]) == 29 for c in streamed)
        assert len({c[0] for c in streamed}) == len(streamed)
        assert (
            [t["token"] for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("content") or ()]
            == [t["token"] for t in whole["logprobs"]["content"]]
            == [s.delta for s in steps[:-1]]
        )  # every token but the end of turn
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
        assert whole["finish_reason"] == ("tool_calls" if message["tool_calls"] else "stop")


def test_a_cut_answer_keeps_its_reason_and_no_logprobs_unless_asked():
    steps = _steps(ANSWERS[1], random.Random(0))
    answer = _answer(steps, finish="length")
    reply = Reply("m", True, False, False, EOT)
    chunks = _streamed(reply, steps, answer)
    assert all(c["choices"][0]["logprobs"] is None and "finish_reason" in c["choices"][0] for c in chunks)
    assert reply.finish_reason(answer) == "length" and reply.completion(answer).choices[0].logprobs is None
    assert reply.chunk(_empty()) is None and reply.chunk(_empty(), force=True) is not None


def test_usage_counts_the_reused_prompt_tokens_and_the_extension_says_where_images_came_from():
    steps = _steps("abc", random.Random(1))
    answer = _answer(steps)
    counted = usage(answer)
    generated = len(steps)  # the end-of-turn token counts: it was generated
    assert (counted.prompt_tokens, counted.completion_tokens, counted.total_tokens) == (
        40,
        generated,
        40 + generated,
    )
    assert counted.prompt_tokens_details.cached_tokens == 30
    assert extension(answer) == {
        "images": [{"index": 0, "source": "memory", "encoder": None, "digest": "d"}], "prefilled_tokens": 10,
        "reused_tokens": 30, "ttft_ms": 12.5, "queue_ms": 0.0,
    }  # fmt: skip
