"""Loading models: aliases, family detection, the image-only processor, tiny test models, the handle."""

from .handle import FAMILIES, FamilySpec, ModelFingerprint, ModelHandle, model_fingerprint
from .load import load, resolve_checkpoint
from .processor import ImageInputs, VLProcessor
from .registry import ALIASES, SHIPPED, TINY
from .tiny import build_tiny

__all__ = [
    "ALIASES",
    "FAMILIES",
    "SHIPPED",
    "TINY",
    "FamilySpec",
    "ImageInputs",
    "ModelFingerprint",
    "ModelHandle",
    "VLProcessor",
    "build_tiny",
    "load",
    "model_fingerprint",
    "resolve_checkpoint",
]
