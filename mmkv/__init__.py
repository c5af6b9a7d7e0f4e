"""mmkv: position-portable KV caching of images and text segments for Qwen2.5-VL / Qwen3-VL agents.

model = mmkv.load("tiny-qwen3-vl")            # or "qwen3-vl-8b", a hub id, a local directory
seg = mmkv.prefill_span(model, ids, positions).segment
moved = seg.moved_to(seg.start + 161)         # exact M-RoPE re-rotation
skill = mmkv.text.precompile(model, "Skill: ...")  # text segments; Session.edit changes a field in place

Importing ``mmkv`` loads only its errors: every other name (and subpackage) is imported on first use, so a
client that needs only ``mmkv.envs`` (the simulated desktop) or ``mmkv.toolcalls`` never imports torch or
transformers, and the ``mmkv`` command answers ``--help`` and argument errors at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from .lazy import lazy_attributes

if TYPE_CHECKING:  # for type checkers and readers; at run time these are imported on first use
    from . import mrope, text
    from .config import SessionConfig
    from .images import load_image
    from .kv import KVSegment, PrefillResult, new_cache, prefill_span, segments_to_cache
    from .model import ModelFingerprint, ModelHandle, VLProcessor, load
    from .policy import TurnPolicy
    from .runtime.plan import ImageReuse
    from .runtime.report import Answer, PrefillStats
    from .session import Session

_LAZY_NAMES = {  # public name -> the module that defines it
    "load_image": "images",
    **dict.fromkeys(["KVSegment", "PrefillResult", "new_cache", "prefill_span", "segments_to_cache"], "kv"),
    **dict.fromkeys(["ModelFingerprint", "ModelHandle"], "model.handle"),
    "VLProcessor": "model.processor",
    "load": "model.load",  # the function, from its module (the package attribute can be the module itself)
    **dict.fromkeys(["Answer", "PrefillStats"], "runtime.report"),
    "ImageReuse": "runtime.plan",
    "Session": "session",
    "SessionConfig": "config",
    "TurnPolicy": "policy",
}
_SUBPACKAGES = frozenset(
    ["cache", "envs", "kv", "model", "mrope", "prompt", "runtime", "serve", "text", "images", "toolcalls"]
)


__getattr__ = lazy_attributes(__name__, globals(), _LAZY_NAMES, _SUBPACKAGES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "Answer",
    "ImageReuse",
    "PrefillStats",
    "Session",
    "SessionConfig",
    "TurnPolicy",
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
