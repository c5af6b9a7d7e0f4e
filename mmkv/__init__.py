"""mmkv: position-portable KV caching of images and text segments for Qwen2.5-VL / Qwen3-VL agents.

model = mmkv.load("tiny-qwen3-vl")            # or "qwen3-vl-8b", a hub id, a local directory
seg = mmkv.prefill_span(model, ids, positions).segment
moved = seg.moved_to(seg.start + 161)         # exact M-RoPE re-rotation
skill = mmkv.text.precompile(model, "Skill: ...")  # text segments; Session.edit changes a field in place
"""

from . import mrope, text
from .errors import (
    EmptyImageError,
    GrammarError,
    ImageError,
    ImageShapeError,
    ImageTooLargeError,
    MmkvError,
    ModelNotFoundError,
    PromptTooLongError,
    StoreMismatchError,
    StoreUnavailableError,
    UnreadableImageError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from .images import load_image
from .kv import KVSegment, PrefillResult, new_cache, prefill_span, segments_to_cache
from .model import ModelFingerprint, ModelHandle, VLProcessor, load
from .session import Answer, ImageReuse, PrefillStats, Session, SessionConfig

__version__ = "0.1.0"

__all__ = [
    "Answer",
    "ImageReuse",
    "PrefillStats",
    "Session",
    "SessionConfig",
    "EmptyImageError",
    "GrammarError",
    "ImageError",
    "ImageShapeError",
    "ImageTooLargeError",
    "StoreMismatchError",
    "StoreUnavailableError",
    "UnreadableImageError",
    "UnsupportedInputError",
    "load_image",
    "KVSegment",
    "MmkvError",
    "ModelFingerprint",
    "ModelHandle",
    "ModelNotFoundError",
    "PromptTooLongError",
    "PrefillResult",
    "UnsupportedModelError",
    "VLProcessor",
    "load",
    "mrope",
    "new_cache",
    "prefill_span",
    "segments_to_cache",
    "text",
]
