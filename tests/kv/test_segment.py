"""The KVSegment record: slots, sizes, cache round trips, validation."""

from __future__ import annotations

import pytest
import torch

from mmkv.kv import KVSegment, image_span, prefill_span, segment_from_cache, segments_to_cache, text_span
from tests.conftest import random_image


@pytest.fixture
def image_segment(tiny) -> KVSegment:
    """A (1, 4, 6)-grid image segment at start 3 (random pixel features)."""
    ids, pos = image_span(tiny, (1, 4, 6), 3)
    features = tiny.processor.preprocess_images([random_image(0, (4, 6), tiny.processor.patch_size)])
    return prefill_span(tiny, ids, pos, images=features).segment


def test_image_segment_slots_and_size(tiny, image_segment):
    """6 pads + 2 markers = 8 tokens; slots max(2, 3) + 2 = 5; K+V bytes = tokens * kv_bytes_per_token."""
    assert image_segment.length == 8
    assert (image_segment.start, image_segment.num_slots, image_segment.end) == (3, 5, 8)
    assert image_segment.nbytes == 8 * tiny.kv_bytes_per_token
    assert image_segment.num_layers == tiny.num_layers


def test_text_segment_slots_equal_length(tiny):
    """A text segment of n tokens occupies n slots."""
    ids, pos = text_span([20, 21, 22, 23], 10)
    seg = prefill_span(tiny, ids, pos).segment
    assert (seg.kind, seg.start, seg.num_slots, seg.end) == ("text", 10, 4, 14)


def test_cache_round_trip_is_bit_exact(tiny, image_segment):
    """Segment -> DynamicCache -> segment returns identical K, V, ids and positions."""
    cache = segments_to_cache([image_segment], tiny.text_config)
    assert cache.get_seq_length() == image_segment.length
    back = segment_from_cache(
        cache, 0, image_segment.token_ids, image_segment.position_ids, tiny.rotary, "image"
    )
    assert torch.equal(back.keys, image_segment.keys) and torch.equal(back.values, image_segment.values)


def test_concat_and_move_back_and_forth(tiny, image_segment):
    """concat tiles segments; moving away and back restores the keys (<= 1e-5) and leaves values untouched."""
    both = KVSegment.concat([image_segment, image_segment.moved_to(image_segment.end)])
    assert both.length == 16 and both.num_slots == 10 and both.kind == "image"
    there_and_back = image_segment.moved_to(500).moved_to(image_segment.start)
    assert torch.equal(there_and_back.position_ids, image_segment.position_ids)
    assert (there_and_back.keys - image_segment.keys).abs().max().item() <= 1e-5
    assert there_and_back.values is image_segment.values
    assert image_segment.moved_to(image_segment.start) is image_segment


def test_invalid_segments_raise(tiny, image_segment):
    """Empty segments and mismatched shapes raise ValueError."""
    with pytest.raises(ValueError, match="empty"):
        KVSegment(
            image_segment.keys[:, :, :, :0],
            image_segment.values[:, :, :, :0],
            torch.zeros(0, dtype=torch.long),
            torch.zeros(3, 0, dtype=torch.long),
            "text",
            "",
            tiny.rotary,
        )
    with pytest.raises(ValueError, match="positions"):
        KVSegment(
            image_segment.keys,
            image_segment.values,
            image_segment.token_ids,
            image_segment.position_ids[:, :-1],
            "image",
            "",
            tiny.rotary,
        )
