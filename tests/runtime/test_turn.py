"""run_turn / turn_steps on each tiny family: a prompt too long for the model refused before anything changes,
chunked prefill equal to one call, store writes only once the logits are known, and a second turn that
keeps the matching prefix and computes only the rest, as exactly as a cold turn."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.errors import PromptTooLongError
from mmkv.runtime import LiveCache, TurnPolicy, TurnStores, check_positions, drain, run_turn, turn_steps
from tests.conftest import random_image
from tests.helpers import held_prompt, synthetic_layout

KV = TurnPolicy(reuse="kv")


def _session(handle: mmkv.ModelHandle) -> mmkv.Session:
    session = mmkv.Session(handle, reuse="none")
    session.add_text("Here is the screen.")
    session.add_image(random_image(7, (4, 6), handle.processor.patch_size))
    return session


def test_check_positions_refuses_exactly_past_the_model_s_positions(tiny):
    layout = synthetic_layout([("text", 5), ("image", 4, 0), ("text", 3)])  # 14 tokens at positions 0..13
    check_positions(replace(tiny, position_limit=layout.num_positions), layout)
    limit = layout.num_positions - 1
    with pytest.raises(PromptTooLongError, match=rf"needs {layout.num_positions} positions; .* has {limit} "):
        check_positions(replace(tiny, position_limit=limit), layout)


def test_a_prompt_too_long_changes_neither_the_live_cache_nor_the_stores(tiny):
    session = _session(tiny)
    layout, live, _, _ = held_prompt(tiny, session, "First?")
    kv_store, encoder_store = KVStore(), EncoderStore()
    longer = session.prompt_layout("A much longer second question about the screen?")
    short = replace(tiny, position_limit=longer.num_positions - 1)
    before = [layer.keys.clone() for layer in live.cache.layers]
    with pytest.raises(PromptTooLongError):
        run_turn(
            short,
            live,
            longer,
            session.conversation.images,
            TurnStores(short, kv_store, encoder_store, KV),
            KV,
        )
    assert live.holds(layout) and all(
        torch.equal(a, b.keys) for a, b in zip(before, live.cache.layers, strict=True)
    )
    assert kv_store.stats().memory.entries == 0 == encoder_store.stats().memory.entries


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_yields_between_calls_and_equals_one_call(tiny, chunk):
    """``chunk_tokens=c``: one yield between each two forward calls of at most c tokens (ceil(L / c) calls),
    the same logits as the unchunked turn (to float32 rounding) and the same prompt held."""
    session = _session(tiny)
    layout, whole, logits, _ = held_prompt(tiny, session, "What is on it?")
    live = LiveCache(tiny)
    steps = turn_steps(tiny, live, layout, session.conversation.images,
                       TurnStores(tiny, KVStore(), EncoderStore(), TurnPolicy(reuse="none")), TurnPolicy(reuse="none"),
                       chunk_tokens=chunk)  # fmt: skip
    yields = 0
    with torch.inference_mode():
        while True:
            try:
                next(steps)
                yields += 1
            except StopIteration as stop:
                chunked, stats = stop.value
                break
    assert yields == -(-layout.num_tokens // chunk) - 1 and stats.prefilled == layout.num_tokens
    assert live.holds(layout) and (chunked.cpu() - logits).abs().max().item() <= 1e-4


def test_store_writes_wait_until_the_logits_are_known(tiny):
    """While a chunked turn is between forward calls the stores hold nothing of it; once it returns they hold
    the image's KV and vision outputs."""
    session = _session(tiny)
    layout = session.prompt_layout("What is on it?")
    digest = session.conversation.images[0].digest
    kv_store, encoder_store = KVStore(), EncoderStore()
    steps = turn_steps(tiny, LiveCache(tiny), layout, session.conversation.images,
                       TurnStores(tiny, kv_store, encoder_store, KV), KV, chunk_tokens=8)  # fmt: skip
    with torch.inference_mode():
        while True:
            try:
                next(steps)
            except StopIteration:
                break
            assert not kv_store.contains(digest, tiny) and not encoder_store.contains(digest, tiny)
    assert kv_store.contains(digest, tiny) and encoder_store.contains(digest, tiny)


def test_the_next_turn_keeps_the_matching_prefix_and_equals_a_cold_turn(tiny):
    """After an answer is added, the next turn on the same live cache computes only what follows the matching
    prefix (``prefilled + reused`` is the prompt) and gives a cold turn's logits (same context: exact up to
    float32 rounding); a given ``keep`` equal to the matching prefix does the same work."""
    session = _session(tiny)
    _, live, _, _ = held_prompt(tiny, session, "What is on it?")
    session.add_text("What is on it?")
    session.add_text("A window.", role="assistant")
    layout = session.prompt_layout("And now?")
    keep = live.matching_prefix(layout)
    copy = live.copy_prefix(keep)
    policy = TurnPolicy(reuse="none")
    with torch.inference_mode():
        warm, stats = run_turn(tiny, live, layout, session.conversation.images,
                               TurnStores(tiny, KVStore(), EncoderStore(), policy), policy)  # fmt: skip
        given, given_stats = drain(turn_steps(tiny, copy, layout, session.conversation.images,
                                              TurnStores(tiny, KVStore(), EncoderStore(), policy), policy, keep=keep))  # fmt: skip
    _, _, cold, cold_stats = held_prompt(tiny, session, "And now?")
    assert keep > 0 and stats.prefilled == layout.num_tokens - keep and stats.reused == keep
    assert cold_stats.prefilled == layout.num_tokens and stats.prompt_tokens == layout.num_tokens
    assert (warm - cold).abs().max().item() <= 1e-4
    assert given_stats.prefilled == stats.prefilled and torch.equal(given.cpu(), warm)
