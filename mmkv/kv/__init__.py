"""KV segments (the shared record of images and text) and the one prefill that builds them."""

from .prefill import PrefillResult, new_cache, prefill_span
from .segment import (
    KVSegment,
    SegmentKind,
    append_to_cache,
    segment_from_cache,
    segments_to_cache,
    stack_cache,
)
from .spans import image_span, text_span
from .vision import ImageFeatures, encode_images, join_features

__all__ = [
    "ImageFeatures",
    "KVSegment",
    "PrefillResult",
    "SegmentKind",
    "append_to_cache",
    "encode_images",
    "new_cache",
    "prefill_span",
    "segment_from_cache",
    "segments_to_cache",
    "stack_cache",
    "image_span",
    "join_features",
    "text_span",
]
