"""ModelRunner on each tiny family: a prefill in chunks of at most ``prefill_chunk`` computed tokens (one call
per chunk, the same logits as a turn at once), abandoned or failed prefills leaving an empty live cache and no
state behind, and a batch of one decoding the token a lone decoder would."""

from __future__ import annotations

import pytest
import torch

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.engine import Request
from mmkv.engine.runner import ModelRunner
from mmkv.runtime import DecodeOptions, Decoder, LiveCache, TurnPolicy, TurnStores
from tests.conftest import random_image
from tests.helpers import held_prompt

NONE = TurnPolicy(reuse="none")


def _session(handle: mmkv.ModelHandle) -> mmkv.Session:
    session = mmkv.Session(handle, reuse="none")
    session.add_text("The screen:")
    session.add_image(random_image(9, (4, 4), handle.processor.patch_size))
    return session


def _request(session: mmkv.Session, question: str = "What now?") -> Request:
    return Request(session.prompt_layout(question), session.conversation.images, NONE, DecodeOptions(4),
                   lambda event: None, live=LiveCache(session.handle))  # fmt: skip


def _stores(policy: TurnPolicy, handle) -> TurnStores:
    return TurnStores(handle, KVStore(), EncoderStore(), policy)


@pytest.mark.parametrize("chunk", [5, 32])
def test_a_prefill_runs_one_chunk_per_call_and_ends_with_the_whole_turn_s_logits(tiny, chunk):
    session = _session(tiny)
    request = _request(session)
    runner = ModelRunner(tiny, lambda policy: _stores(policy, tiny), chunk)
    calls, result = 1, runner.prefill(request)
    while result is None:
        calls, result = calls + 1, runner.prefill(request)
    logits, stats = result
    _, _, whole, _ = held_prompt(tiny, session, "What now?")
    assert calls == -(-request.layout.num_tokens // chunk) and stats.prefilled == request.layout.num_tokens
    assert request.live.holds(request.layout) and (logits.cpu() - whole).abs().max().item() <= 1e-4
    assert runner._prefills == {}


def test_an_abandoned_prefill_empties_its_cache_and_a_new_one_starts_from_scratch(tiny):
    session = _session(tiny)
    request = _request(session)
    runner = ModelRunner(tiny, lambda policy: _stores(policy, tiny), 4)
    assert runner.prefill(request) is None and request.live.cache.get_seq_length() == 4  # one chunk in
    runner.abandon(request)
    assert request.live.num_tokens == 0 == request.live.cache.get_seq_length() and runner._prefills == {}
    runner.abandon(request)  # twice: nothing left to stop
    runner.prefill_chunk = None
    logits, stats = runner.prefill(request)
    assert stats.prefilled == request.layout.num_tokens and request.live.holds(request.layout)


def test_a_failed_prefill_empties_its_cache_propagates_and_leaves_the_runner_usable(tiny):
    """The stores fail on the image's vision outputs: the error reaches the caller, the live cache is empty,
    and the next request's prefill (working stores) completes."""

    class Failing(TurnStores):
        def features(self, image):
            raise OSError("the encoder store went away")

    failing = True
    runner = ModelRunner(
        tiny, lambda p: (Failing if failing else TurnStores)(tiny, KVStore(), EncoderStore(), p), 8
    )
    session = _session(tiny)
    request = _request(session)
    with pytest.raises(OSError, match="went away"):
        while runner.prefill(request) is None:
            pass
    assert request.live.num_tokens == 0 and runner._prefills == {}
    failing = False
    other = _request(session)
    while (result := runner.prefill(other)) is None:
        pass
    assert result[1].prefilled == other.layout.num_tokens


def test_a_batch_of_one_decodes_the_token_a_lone_decoder_appends(tiny):
    """join, one batched decode step, leave: the batch's logits equal those a lone decoder's ``extend`` gives
    for the same pending token (float32 rounding), and the live cache holds the prompt and that token."""
    session = _session(tiny)
    request = _request(session)
    runner = ModelRunner(tiny, lambda policy: _stores(policy, tiny), None)
    logits, _ = runner.prefill(request)
    request.decoder = Decoder(tiny, request.live, logits, request.options)
    request.decoder.advance()  # the first token, from the prompt's logits: now pending
    lone = request.live.copy_prefix(request.live.num_tokens)
    runner.join(request)
    batched = runner.decode([request])[0]
    runner.leave(request)
    with torch.inference_mode():
        expected = lone.extend(
            torch.tensor([request.decoder.pending]), torch.full((3, 1), request.decoder.pending_position)
        )
    assert batched.shape == expected.shape and (batched.cpu() - expected.cpu()).abs().max().item() <= 1e-4
    assert request.live.num_tokens == request.layout.num_tokens + 1
