"""TurnStores and prepare_image on each tiny family: what a turn reads under each policy, the vision tower run
at most once per image and turn, writes held back until ``flush`` and equal to what the cache holds, the
preprocessed inputs made when an image is added (unless its vision outputs are stored), and stored KV this
model could not have made refused."""

from __future__ import annotations

import pytest
import torch

import mmkv
import mmkv.runtime.stores as stores_module
from mmkv.cache import EncoderStore, KVStore
from mmkv.cache.memory import MemoryTier
from mmkv.errors import StoreMismatchError
from mmkv.messages import ConversationImage
from mmkv.runtime import StoreWrite, TurnPolicy, TurnStores, prepare_image
from tests.conftest import random_image
from tests.helpers import IMAGE_IDS, held_prompt, synthetic_segment


@pytest.fixture
def tower_calls(monkeypatch) -> list[str]:
    """The input shapes of each vision-tower call made through ``stores_module.encode_images``, in order."""
    calls: list[str] = []
    real = stores_module.encode_images

    def counted(handle, inputs):
        calls.append(tuple(inputs.pixel_values.shape))
        return real(handle, inputs)

    monkeypatch.setattr(stores_module, "encode_images", counted)
    return calls


def _image(handle: mmkv.ModelHandle, seed: int = 1) -> ConversationImage:
    policy, vision_inputs = TurnPolicy(reuse="none"), MemoryTier(64 << 20)
    return prepare_image(handle, random_image(seed, (4, 4), handle.processor.patch_size), 1 << 20, policy,
                         EncoderStore(), vision_inputs)  # fmt: skip


def test_the_tower_runs_once_per_image_and_turn_and_outputs_are_stored_only_on_flush(tiny, tower_calls):
    """``features`` twice: one tower call, the same outputs; nothing in the encoder store until ``flush``;
    a later turn finds them there (tier ``memory``) and runs no tower."""
    kv_store, encoder_store, image = KVStore(), EncoderStore(), _image(tiny)
    turn = TurnStores(tiny, kv_store, encoder_store, TurnPolicy(reuse="kv"))
    assert turn.encoder_tier(image) == "computed"
    with torch.inference_mode():
        first, again = turn.features(image), turn.features(image)
    assert len(tower_calls) == 1 and first is again and not encoder_store.contains(image.digest, tiny)
    turn.flush(mmkv.runtime.LiveCache(tiny), [])
    assert encoder_store.contains(image.digest, tiny)
    later = TurnStores(tiny, kv_store, encoder_store, TurnPolicy(reuse="encoder"))
    assert later.encoder_tier(image) == "memory"
    stored = later.features(image)
    assert len(tower_calls) == 1 and torch.equal(stored[0].embeds, first[0].embeds)


def test_full_recompute_reads_and_writes_no_store(tiny, tower_calls):
    """Under ``none`` an image whose vision outputs are stored is not looked up (no hit, no miss counted, KV or
    vision outputs): the tower runs again, and nothing is queued for the store."""
    kv_store, encoder_store, image = KVStore(), EncoderStore(), _image(tiny, seed=2)
    stored = TurnStores(tiny, kv_store, encoder_store, TurnPolicy(reuse="kv"))
    with torch.inference_mode():
        stored.features(image)
    stored.flush(mmkv.runtime.LiveCache(tiny), [])
    counts = [
        (s.memory.hits, s.memory.misses, s.memory.entries) for s in (kv_store.stats(), encoder_store.stats())
    ]
    turn = TurnStores(tiny, kv_store, encoder_store, TurnPolicy(reuse="none"))
    assert turn.kv(image) == (None, None) and turn.encoder_tier(image) == "computed"
    with torch.inference_mode():
        turn.features(image)
    turn.flush(mmkv.runtime.LiveCache(tiny), [])
    assert len(tower_calls) == 2
    assert counts == [
        (s.memory.hits, s.memory.misses, s.memory.entries) for s in (kv_store.stats(), encoder_store.stats())
    ]


def test_flush_stores_the_image_kv_the_live_cache_holds(tiny):
    """A turn under ``kv`` with a fresh store: after it, the store's segment for the image is, bit for bit,
    the live cache's entries of that image (ids, positions, keys, values)."""
    session = mmkv.Session(tiny, reuse="none")
    session.add_image(random_image(3, (4, 4), tiny.processor.patch_size))
    kv_store, encoder_store = KVStore(), EncoderStore()
    layout, live, _, _ = held_prompt(
        tiny, session, "What is it?", TurnPolicy(reuse="kv"), (kv_store, encoder_store)
    )
    piece = next(p for p in layout.pieces if p.kind == "image")
    stored, tier = kv_store.lookup(layout.digest_of(piece), tiny)
    held = live.segment(piece.begin, piece.end, "image", layout.digest_of(piece))
    assert tier == "memory" and stored.kind == "image"
    for name in ("keys", "values", "token_ids", "position_ids"):
        assert torch.equal(getattr(stored, name), getattr(held, name)), name
    with pytest.raises(ValueError, match="no live entries"):  # a write the cache does not hold
        TurnStores(tiny, kv_store, encoder_store, TurnPolicy(reuse="kv")).flush(
            live, [StoreWrite(live.num_tokens - 2, 5, "beyond")]
        )


class _Handing:
    """A KV store that hands back one fixed segment for every digest."""

    def __init__(self, segment):
        self.segment = segment

    def lookup(self, digest, handle):
        return self.segment, "disk"


def test_stored_kv_of_another_shape_is_refused_naming_both_shapes(tiny):
    image = _image(tiny, seed=4)
    wrong = synthetic_segment(IMAGE_IDS)  # 2 layers, 1 KV head, head_dim 8
    turn = TurnStores(tiny, _Handing(wrong), EncoderStore(), TurnPolicy(reuse="kv"))
    with pytest.raises(StoreMismatchError, match=r"\(2, 1, 8\); this model has") as refused:
        turn.kv(image)
    assert str(tuple(tiny.kv_shape)) in str(refused.value)


def test_prepare_image_preprocesses_now_unless_the_outputs_are_stored(tiny, monkeypatch):
    """The preprocessed inputs are made when the image is added; a turn then never preprocesses it again. When
    the encoder store holds the image's outputs (and the policy reads stores) nothing is preprocessed."""
    source, vision_inputs = random_image(5, (4, 4), tiny.processor.patch_size), MemoryTier(64 << 20)
    record = prepare_image(tiny, source, 1 << 20, TurnPolicy(reuse="kv"), EncoderStore(), vision_inputs)
    assert record.digest in vision_inputs

    def refuse(handle, image):
        raise AssertionError("preprocessed again")

    monkeypatch.setattr(stores_module, "preprocess", refuse)
    with torch.inference_mode():
        TurnStores(tiny, KVStore(), EncoderStore(), TurnPolicy(reuse="kv"), vision_inputs).features(record)
    encoder_store, empty = EncoderStore(), MemoryTier(64 << 20)
    with torch.inference_mode():
        features = TurnStores(
            tiny, KVStore(), EncoderStore(), TurnPolicy(reuse="kv"), vision_inputs
        ).features(record)
    encoder_store.put(record.digest, features, tiny)
    again = prepare_image(tiny, source, 1 << 20, TurnPolicy(reuse="encoder"), encoder_store, empty)
    assert again.digest == record.digest and again.digest not in empty
    with pytest.raises(AssertionError, match="preprocessed again"):  # under none it would be needed
        prepare_image(tiny, source, 1 << 20, TurnPolicy(reuse="none"), encoder_store, empty)
