"""Prefilled and moved segments against the model's own computation, both families, fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmkv.kv import (
    ImageFeatures,
    KVSegment,
    encode_images,
    image_span,
    prefill_span,
    segments_to_cache,
    text_span,
)
from tests.conftest import random_image, random_text_ids

PREAMBLE_LEN = 7


def _image_inputs(handle, seed=0, grid_hw=(4, 6)):
    image = random_image(seed, grid_hw, handle.processor.patch_size)
    return handle.processor.preprocess_images([image])


def _image_after_preamble(handle, preamble, images, offset: int) -> KVSegment:
    """The image segment prefilled after ``preamble`` whose first token sits at ``offset``."""
    ids, pos = text_span(preamble, offset)
    context = prefill_span(handle, ids, pos).cache
    ids, pos = image_span(handle, images.image_grid_thw[0], offset + len(preamble))
    return prefill_span(handle, ids, pos, context=context, images=images).segment


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_moved_image_segment_equals_prefill_at_the_new_position(tiny):
    """Same preamble, start s vs s': moved K and V equal the directly prefilled ones (<= 1e-5) for deltas
    161, -13 and 37; rotating only the temporal channels does not."""
    rng = np.random.default_rng(0)
    preamble = random_text_ids(tiny, rng, PREAMBLE_LEN)
    images = _image_inputs(tiny)
    base = _image_after_preamble(tiny, preamble, images, offset=20)
    assert base.kind == "image" and base.start == 20 + PREAMBLE_LEN
    for delta in (161, -13, 37):
        target = _image_after_preamble(tiny, preamble, images, offset=20 + delta)
        moved = base.moved_to(target.start)
        assert torch.equal(moved.position_ids, target.position_ids)
        assert _max_abs(moved.keys, target.keys) <= 1e-5
        assert _max_abs(moved.values, target.values) <= 1e-5
        temporal_only = base.moved_to(target.start, axes=(0,))
        assert _max_abs(temporal_only.keys, target.keys) > 1e-2


def test_deepstack_is_in_the_prefill_and_encoder_outputs_reproduce_it(tiny_by_name):
    """Qwen3-VL: prefilling from cached vision outputs equals prefilling from pixels (<= 1e-6), and zeroing
    the DeepStack features changes the image KV (so the tests above cover DeepStack)."""
    handle = tiny_by_name["tiny-qwen3-vl"]
    images = _image_inputs(handle, seed=3)
    ids, pos = image_span(handle, images.image_grid_thw[0], start=5)
    from_pixels = prefill_span(handle, ids, pos, images=images).segment
    (encoded,) = encode_images(handle, images)
    assert len(encoded.deepstack) == 3 and encoded.num_pads == ids.shape[0] - 2
    from_cache = prefill_span(handle, ids, pos, features=[encoded]).segment
    assert _max_abs(from_pixels.keys, from_cache.keys) <= 1e-6
    assert _max_abs(from_pixels.values, from_cache.values) <= 1e-6
    zeroed = ImageFeatures(encoded.embeds, tuple(torch.zeros_like(t) for t in encoded.deepstack))
    no_deepstack = prefill_span(handle, ids, pos, features=[zeroed]).segment
    assert _max_abs(from_pixels.keys[1:], no_deepstack.keys[1:]) > 1e-3


def _two_image_prompt(handle, rng):
    """Spans of: text, image A, text, image B, question (as token ids and image inputs)."""
    texts = [random_text_ids(handle, rng, n) for n in (9, 4, 6)]
    image_a = _image_inputs(handle, seed=1, grid_hw=(4, 6))
    image_b = _image_inputs(handle, seed=2, grid_hw=(6, 2))
    return texts, image_a, image_b


def _full_forward_logits(handle, texts, image_a, image_b) -> torch.Tensor:
    """Next-token logits of one ordinary forward: the model computes positions itself (get_rope_index)."""
    proc = handle.processor
    ids = torch.cat(
        [
            texts[0],
            image_span(handle, image_a.image_grid_thw[0], 0)[0],
            texts[1],
            image_span(handle, image_b.image_grid_thw[0], 0)[0],
            texts[2],
        ]
    )[None]
    with torch.inference_mode():
        out = handle.model(
            input_ids=ids,
            pixel_values=torch.cat([image_a.pixel_values, image_b.pixel_values]),
            image_grid_thw=torch.cat([image_a.image_grid_thw, image_b.image_grid_thw]),
            mm_token_type_ids=(ids == proc.image_token_id).int(),
        )
    handle.model.model.rope_deltas = None  # leave no state behind for later tests
    return out.logits[0, -1].float()


def _segments_in_order(handle, texts, image_a, image_b, offset=0):
    """Prefill the prompt span by span in one cache; returns the segments and the question's logits."""
    segments, context, position = [], None, offset
    for part in (texts[0], image_a, texts[1], image_b, texts[2]):
        if isinstance(part, torch.Tensor):
            ids, pos = text_span(part, position)
            result = prefill_span(handle, ids, pos, context=context)
        else:
            ids, pos = image_span(handle, part.image_grid_thw[0], position)
            result = prefill_span(handle, ids, pos, context=context, images=part)
        segments.append(result.segment)
        context, position = result.cache, result.segment.end
    return segments, result.logits


def test_cache_from_segments_continues_like_one_full_forward(tiny):
    """Segments prefilled one by one, put into a fresh DynamicCache and continued with explicit positions,
    give the next-token logits of one full forward over the same tokens (max abs <= 1e-4)."""
    rng = np.random.default_rng(1)
    texts, image_a, image_b = _two_image_prompt(tiny, rng)
    reference = _full_forward_logits(tiny, texts, image_a, image_b)
    segments, logits_in_one_cache = _segments_in_order(tiny, texts, image_a, image_b)
    assert _max_abs(logits_in_one_cache, reference) <= 1e-4
    cache = segments_to_cache(segments[:-1], tiny.text_config)
    question = segments[-1]
    spliced = prefill_span(tiny, question.token_ids, question.position_ids, context=cache)
    assert _max_abs(spliced.logits, reference) <= 1e-4
    assert _max_abs(spliced.segment.keys, question.keys) <= 1e-5


def test_whole_prompt_moved_by_splicing_equals_prefill_at_the_offset(tiny):
    """Every segment moved by +95 and spliced gives the logits of prefilling the prompt at offset 95."""
    rng = np.random.default_rng(2)
    texts, image_a, image_b = _two_image_prompt(tiny, rng)
    segments, _ = _segments_in_order(tiny, texts, image_a, image_b)
    _, shifted_reference = _segments_in_order(tiny, texts, image_a, image_b, offset=95)
    moved = [s.moved_to(s.start + 95) for s in segments[:-1]]
    cache = segments_to_cache(moved, tiny.text_config)
    question = segments[-1]
    result = prefill_span(tiny, question.token_ids, question.position_ids + 95, context=cache)
    assert _max_abs(result.logits, shifted_reference) <= 1e-4


def test_prefill_rejects_pads_without_features_and_bad_positions(tiny):
    """Image pads with no images or encoder output, and positions of the wrong shape, raise ValueError."""
    ids, pos = image_span(tiny, (1, 4, 4), 0)
    with pytest.raises(ValueError, match="image pads"):
        prefill_span(tiny, ids, pos)
    with pytest.raises(ValueError, match="position_ids"):
        prefill_span(tiny, ids[:3], pos)


def test_two_images_in_one_span_from_cached_features_equal_from_pixels(tiny):
    """Both families: a span holding two images prefilled from cached per-image features (encoded separately)
    equals prefilling it from pixels (<= 1e-5): the exact 'encoder' reuse path."""
    image_a, image_b = (
        _image_inputs(tiny, seed=1, grid_hw=(4, 6)),
        _image_inputs(tiny, seed=2, grid_hw=(6, 2)),
    )
    ids_a, pos_a = image_span(tiny, image_a.image_grid_thw[0], 3)
    ids_b, pos_b = image_span(tiny, image_b.image_grid_thw[0], int(pos_a.max()) + 1)
    ids, pos = torch.cat([ids_a, ids_b]), torch.cat([pos_a, pos_b], dim=1)
    both = type(image_a)(
        torch.cat([image_a.pixel_values, image_b.pixel_values]),
        torch.cat([image_a.image_grid_thw, image_b.image_grid_thw]),
    )
    from_pixels = prefill_span(tiny, ids, pos, images=both)
    features = encode_images(tiny, image_a) + encode_images(tiny, image_b)
    from_features = prefill_span(tiny, ids, pos, features=features)
    assert _max_abs(from_pixels.segment.keys, from_features.segment.keys) <= 1e-5
    assert _max_abs(from_pixels.logits, from_features.logits) <= 1e-4
    with pytest.raises(ValueError, match="features cover"):
        prefill_span(tiny, ids, pos, features=features[:1])
