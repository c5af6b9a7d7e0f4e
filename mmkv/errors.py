"""mmkv's exceptions: one family, each message saying what to change.

Every error mmkv raises on purpose derives from ``MmkvError``; each also derives from the builtin a caller
would expect (``FileNotFoundError``, ``ValueError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "EmptyImageError",
    "GrammarError",
    "GrammarTimeoutError",
    "ImageError",
    "ImageShapeError",
    "ImageTooLargeError",
    "MmkvError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "StoreMismatchError",
    "StoreUnavailableError",
    "UnreadableImageError",
    "UnsupportedInputError",
    "UnsupportedModelError",
]


class MmkvError(Exception):
    """Base class of every error mmkv raises on purpose."""


class ModelNotFoundError(MmkvError, FileNotFoundError):
    """A checkpoint is neither a local directory nor in the local Hugging Face cache, and cannot be fetched."""


class UnsupportedModelError(MmkvError, ValueError):
    """A checkpoint loaded, but its architecture is not one mmkv knows how to cache (no family in ``mmkv.model.families`` serves its ``model_type``)."""


class ImageError(MmkvError, ValueError):
    """An image that cannot be used; the subclasses say why."""


class UnreadableImageError(ImageError):
    """Bytes or a file that do not decode as an image, or a truncated image."""


class ImageTooLargeError(ImageError):
    """An image whose pixel count exceeds the bound (a decompression bomb, or simply too big)."""


class ImageShapeError(ImageError):
    """An image of a shape the model's processor refuses (an aspect ratio over 200:1)."""


class EmptyImageError(ImageError):
    """An image with zero width or height."""


class UnsupportedInputError(MmkvError, TypeError):
    """An input of a type mmkv does not take (images: PIL image, path or bytes)."""


class StoreMismatchError(MmkvError, ValueError):
    """A store or cached entry made for another model (fingerprint) than the one it is used with."""


class StoreUnavailableError(MmkvError, OSError):
    """A store's directory cannot be opened: a file where the directory should be, no permission, a corrupt
    index, a full disk. The message says which and what to do. (Once open, storage faults never raise.)"""


class PromptTooLongError(MmkvError, ValueError):
    """A prompt that needs more positions than the model has (``max_position_embeddings``)."""


class GrammarError(MmkvError, ValueError):
    """A response format or tool list that cannot become a token constraint: an invalid JSON schema, a schema
    keyword the grammar engine cannot enforce (under ``strict``), an empty tool list, a named tool that is not
    listed. The message names the offending field and what to change (the server answers it with a 400)."""


class GrammarTimeoutError(MmkvError, TimeoutError):
    """Grammar work (a schema's checks, a compile) whose turn did not come before the caller's deadline: other
    requests' schemas held it (the server answers 504)."""
