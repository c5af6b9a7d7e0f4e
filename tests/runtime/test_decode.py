"""The one decode loop (``mmkv.runtime.decode``): text, stop strings, budgets, sampling edges, logprobs, cost."""

from __future__ import annotations

import torch

import mmkv
from mmkv.runtime import DecodeOptions, Decoder, LiveCache, TurnPolicy, run_turn
from mmkv.runtime.answer_text import token_bytes
from mmkv.runtime.decode import end_of_turn_id, vision_token_ids

from ..conftest import random_image


def _prompt(session: mmkv.Session, question: str):
    """The live cache brought up to ``question`` and its first-token logits."""
    return session.next_token_logits(question), session.live


class _FakeModelLive:
    """A stand-in live cache whose next logits come from a fixed script (no model): decoding logic alone."""

    def __init__(self, vocab: int, script: list[int]) -> None:
        self.vocab, self.script, self.calls, self.next_position = vocab, list(script), 0, 10

    def extend(self, token_ids, positions):
        self.calls += 1
        return self.logits_for(self.calls)

    def logits_for(self, step: int) -> torch.Tensor:
        logits = torch.zeros(self.vocab)
        logits[self.script[min(step, len(self.script) - 1)]] = 10.0
        return logits


def _scripted(handle, script: list[int], options: DecodeOptions) -> Decoder:
    live = _FakeModelLive(int(handle.model.get_output_embeddings().weight.shape[0]), script)
    return Decoder(handle, live, live.logits_for(0), options)


def test_the_answer_ends_once_for_each_reason(tiny):
    """End of turn, a stop string and the budget each end the answer with their finish reason; the token
    that ends it is never appended to the cache; a should_stop hook cancels before the next token."""
    eos = end_of_turn_id(tiny)
    word = tiny.tokenizer.encode("go", add_special_tokens=False)[0]
    ended = _scripted(tiny, [word, word, eos, word], DecodeOptions(10))
    steps = list(ended)
    assert ended.finish_reason == "stop" and [s.token for s in steps] == [word, word, eos]
    assert ended.live.calls == 2  # the eos was chosen, not appended
    budget = _scripted(tiny, [word] * 10, DecodeOptions(4))
    assert len(list(budget)) == 4 and budget.finish_reason == "length" and budget.live.calls == 3
    stopped = _scripted(tiny, [word] * 10, DecodeOptions(10, stops=(tiny.tokenizer.decode([word]),)))
    list(stopped)
    assert stopped.finish_reason == "stop" and stopped.text == "" and len(stopped.token_ids) == 1
    calls = iter([False, False, True])
    cancelled = Decoder(tiny, _FakeModelLive(len(tiny.tokenizer) + 64, [word] * 10),
                        torch.zeros(len(tiny.tokenizer) + 64), DecodeOptions(10), should_stop=lambda: next(calls))  # fmt: skip
    assert len(list(cancelled)) == 2 and cancelled.finish_reason == "cancelled"


def test_logprobs_are_the_log_softmax_of_the_models_own_logits(tiny):
    """Every generated token's logprob equals the log-softmax of the model's logits at its position in one
    plain forward of the model over prompt + answer (its own positions and vision tower; <= 1e-4), the top
    alternatives are sorted, and the bytes are the token's exact bytes."""
    image = random_image(3, (4, 6), tiny.processor.patch_size)
    session = mmkv.Session(tiny, reuse="none")
    session.add_image(image)
    prompt_ids = session.render("Describe it.")[0]
    answer = session.ask("Describe it.", max_new_tokens=6, logprobs=5)
    assert answer.logprobs is not None and len(answer.logprobs) == len(answer.token_ids)
    text = tiny.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    )
    inputs = tiny.processor(text, [image])
    assert torch.equal(inputs["input_ids"][0], prompt_ids)
    extra = torch.tensor([answer.token_ids[:-1]], dtype=torch.long)  # (1, n - 1): the answer as context
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = torch.cat(
        [inputs["mm_token_type_ids"], torch.zeros_like(extra, dtype=torch.int)], 1
    )
    with torch.inference_mode():
        logits = tiny.model(**inputs).logits[0].double()  # (L, vocab)
    start = int(prompt_ids.shape[0]) - 1
    for step, entry in enumerate(answer.logprobs):
        expected = torch.log_softmax(logits[start + step], -1)
        assert entry.token_id == answer.token_ids[step]
        assert abs(entry.logprob - float(expected[entry.token_id])) <= 1e-4
        values = [t.logprob for t in entry.top]
        assert values == sorted(values, reverse=True) and len(entry.top) == 5
        assert all(abs(t.logprob - float(expected[t.token_id])) <= 1e-4 for t in entry.top)
        assert entry.bytes == tuple(token_bytes(tiny.tokenizer, entry.token_id))
        assert [t.token_id for t in entry.top] == expected.topk(5).indices.tolist()


def test_vision_tokens_are_banned_and_the_budget_respects_the_positions_left(tiny, monkeypatch):
    """No answer token is a vision token even when the logits favour one; with one position left the budget is
    one token (the first comes from the prompt's logits and is not appended)."""
    banned = vision_token_ids(tiny)
    live = _FakeModelLive(len(tiny.tokenizer) + 64, [banned[0]] * 5)
    decoder = Decoder(tiny, live, live.logits_for(0), DecodeOptions(5))
    assert all(step.token not in banned for step in decoder)
    monkeypatch.setattr(type(tiny), "max_positions", property(lambda self: 10))  # the fake is at position 10
    ordinary = len(tiny.family.special_tokens) + 7  # the tiny tokenizers put the special tokens first
    short = _scripted(tiny, [ordinary] * 5, DecodeOptions(5))
    assert short.budget == 1 and len(list(short)) == 1 and short.finish_reason == "length"
    assert short.live.calls == 0


def test_session_and_worker_use_the_same_decoder(tiny):
    """Session.ask's answer equals a Decoder run by hand over run_turn's logits on a fresh live cache (the
    server's path), token for token."""
    session = mmkv.Session(tiny, reuse="none")
    session.add_image(random_image(3, (4, 6), tiny.processor.patch_size))
    asked = session.fork().ask("What now?", max_new_tokens=8)
    layout = session.prompt_layout("What now?")
    live = LiveCache(tiny)
    with torch.inference_mode():
        cold = TurnPolicy(reuse="none")
        logits, _ = run_turn(
            tiny, live, layout, session.conversation.images, session._turn_stores(cold), cold
        )
        decoder = Decoder(tiny, live, logits, DecodeOptions(8))
        list(decoder)
    assert tuple(decoder.token_ids) == asked.token_ids and decoder.text == asked.text
