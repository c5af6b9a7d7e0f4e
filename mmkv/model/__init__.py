"""Loading models: the families (``families/``), aliases, the image-only processor, tiny test models, the handle.

The registry's names (``ALIASES``, ``SHIPPED``, ``TINY``) import nothing heavy; the rest (torch, transformers)
is imported on first use, so the ``mmkv`` command can check a model name before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_attributes
from .families import FAMILIES, Family, family_of
from .registry import ALIASES, SHIPPED, TINY

if TYPE_CHECKING:  # imported on first use
    from .checkpoint import resolve_checkpoint
    from .handle import ModelFingerprint, ModelHandle, model_fingerprint
    from .load import load
    from .processor import ImageInputs, VLProcessor
    from .tiny import build_tiny

_LAZY_NAMES = {  # public name -> the module that defines it
    **dict.fromkeys(["ModelFingerprint", "ModelHandle", "model_fingerprint"], "handle"),
    # "load" names both the function and its module: reading mmkv.model.load gives the function, unless the
    # module mmkv.model.load was imported before (the import system then binds the module); mmkv.load is always
    # the function
    "load": "load",
    "resolve_checkpoint": "checkpoint",
    **dict.fromkeys(["ImageInputs", "VLProcessor"], "processor"),
    "build_tiny": "tiny",
}
_SUBMODULES = frozenset(["checkpoint", "handle", "load", "processor", "reference", "registry", "tiny"])


__getattr__ = lazy_attributes(__name__, globals(), _LAZY_NAMES, _SUBMODULES)


__all__ = [
    "ALIASES",
    "FAMILIES",
    "SHIPPED",
    "TINY",
    "Family",
    "ImageInputs",
    "ModelFingerprint",
    "ModelHandle",
    "VLProcessor",
    "build_tiny",
    "family_of",
    "load",
    "model_fingerprint",
    "resolve_checkpoint",
]
