"""mmkv's exceptions: one family, each message saying what to change.

Every error mmkv raises on purpose derives from ``MmkvError``; each also derives from the builtin a caller
would expect (``FileNotFoundError``, ``ValueError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = ["MmkvError", "ModelNotFoundError", "UnsupportedModelError"]


class MmkvError(Exception):
    """Base class of every error mmkv raises on purpose."""


class ModelNotFoundError(MmkvError, FileNotFoundError):
    """A checkpoint is neither a local directory nor in the local Hugging Face cache, and cannot be fetched."""


class UnsupportedModelError(MmkvError, ValueError):
    """A checkpoint loaded, but its architecture is not one mmkv knows how to cache (Qwen2/2.5/3-VL)."""
