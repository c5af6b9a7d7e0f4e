"""The record codec: exact round trips (float32, bfloat16, DeepStack features) and every rejection on decode."""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
import torch

from mmkv.cache import CorruptEntryError, image_digest
from mmkv.cache.codec import decode_features, decode_segment, encode_features, encode_segment
from mmkv.kv import KVSegment, encode_images, image_span, prefill_span
from tests.conftest import random_image


@pytest.fixture
def image(tiny):
    """A (4, 6)-grid noise image, its processor inputs and its digest."""
    pil = random_image(0, (4, 6), tiny.processor.patch_size)
    return tiny.processor.preprocess_images([pil]), image_digest(pil, tiny.processor, tiny.fingerprint)


@pytest.fixture
def segment(tiny, image) -> KVSegment:
    """The image's KV segment at start 3, named by its digest."""
    inputs, digest = image
    ids, pos = image_span(tiny, inputs.image_grid_thw[0], 3)
    return prefill_span(tiny, ids, pos, images=inputs, digest=digest).segment


def assert_same_segment(a: KVSegment, b: KVSegment) -> None:
    """Bit-identical K, V, ids and positions (dtype included), equal kind and digest."""
    for name in ("keys", "values", "token_ids", "position_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.kind, a.digest) == (b.kind, b.digest)


def _payload_middle(data: bytes) -> int:
    """Offset of the middle byte of a safetensors record's tensor payload."""
    (header,) = struct.unpack("<Q", data[:8])
    return 8 + header + (len(data) - 8 - header) // 2


def test_segment_round_trip_is_bit_exact(tiny, segment):
    """encode_segment -> decode_segment returns identical tensors, kind and digest, with the handle's layout."""
    back = decode_segment(
        encode_segment(segment, tiny.fingerprint), tiny.fingerprint, segment.digest, tiny.rotary, "cpu"
    )
    assert_same_segment(back, segment)
    assert back.rotary is tiny.rotary and back.token_ids.dtype == torch.long


def test_bfloat16_and_strided_tensors_round_trip(tiny, segment):
    """bfloat16 K/V and non-contiguous views come back byte for byte (dtype and layout normalised, values kept)."""
    bf16 = replace(segment, keys=segment.keys.to(torch.bfloat16), values=segment.values.to(torch.bfloat16))
    back = decode_segment(
        encode_segment(bf16, tiny.fingerprint), tiny.fingerprint, bf16.digest, tiny.rotary, "cpu"
    )
    assert back.keys.dtype == torch.bfloat16
    assert_same_segment(back, bf16)
    assert torch.equal(back.keys.view(torch.int16), bf16.keys.view(torch.int16))
    strided = replace(segment, keys=segment.keys.transpose(3, 4).contiguous().transpose(3, 4))
    assert not strided.keys.is_contiguous()
    back = decode_segment(
        encode_segment(strided, tiny.fingerprint), tiny.fingerprint, strided.digest, tiny.rotary, "cpu"
    )
    assert_same_segment(back, segment)


def test_features_round_trip_with_deepstack(tiny, image):
    """encode_features -> decode_features returns identical embeds and DeepStack tensors (3 for tiny-qwen3-vl)."""
    inputs, digest = image
    features = encode_images(tiny, inputs)
    expected_deepstack = 3 if tiny.family.has_deepstack else 0
    assert len(features[0].deepstack) == expected_deepstack
    back = decode_features(
        encode_features(features, tiny.fingerprint, digest), tiny.fingerprint, digest, "cpu"
    )
    assert len(back) == len(features) == 1
    assert len(back[0].deepstack) == expected_deepstack
    for got, want in zip(
        (back[0].embeds, *back[0].deepstack), (features[0].embeds, *features[0].deepstack), strict=True
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_truncated_records_are_rejected(tiny, segment):
    """Every truncation (empty, inside the preamble, header or payload, one byte short) raises 'truncated'."""
    data = encode_segment(segment, tiny.fingerprint)
    for size in (0, 5, 8, 20, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptEntryError, match="truncated or unparseable"):
            decode_segment(data[:size], tiny.fingerprint, segment.digest, tiny.rotary, "cpu")


def test_flipped_payload_byte_fails_the_checksum(tiny, segment):
    """One flipped bit in the middle of the tensor payload raises 'checksum mismatch'."""
    data = bytearray(encode_segment(segment, tiny.fingerprint))
    data[_payload_middle(bytes(data))] ^= 0x01
    with pytest.raises(CorruptEntryError, match="checksum mismatch"):
        decode_segment(bytes(data), tiny.fingerprint, segment.digest, tiny.rotary, "cpu")


def test_wrong_fingerprint_digest_kind_or_version_are_rejected(tiny, segment):
    """Another model's fingerprint, another digest, a features decode of a segment record and an unknown
    version each raise CorruptEntryError naming what failed."""
    data = encode_segment(segment, tiny.fingerprint)
    with pytest.raises(CorruptEntryError, match="fingerprint mismatch"):
        decode_segment(data, "0" * 64, segment.digest, tiny.rotary, "cpu")
    with pytest.raises(CorruptEntryError, match="digest mismatch"):
        decode_segment(data, tiny.fingerprint, "f" * 64, tiny.rotary, "cpu")
    with pytest.raises(CorruptEntryError, match="kind mismatch"):
        decode_features(data, tiny.fingerprint, segment.digest, "cpu")
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    meta = json.loads(header["__metadata__"]["mmkv"])
    header["__metadata__"]["mmkv"] = json.dumps({**meta, "format": 99})
    new_header = json.dumps(header).encode()
    forged = struct.pack("<Q", len(new_header)) + new_header + data[8 + size :]
    with pytest.raises(CorruptEntryError, match="unknown record format version 99"):
        decode_segment(forged, tiny.fingerprint, segment.digest, tiny.rotary, "cpu")


def test_corrupt_entry_error_is_a_value_error():
    """CorruptEntryError derives from ValueError, so `except ValueError` callers keep working."""
    assert issubclass(CorruptEntryError, ValueError)
