"""Lazy package attributes: a package's public names and submodules imported on first use (PEP 562), so that
``import mmkv`` (or ``mmkv.cache``, ``mmkv.model``) loads neither torch nor transformers until a name that needs
them is used. Example::

    __getattr__ = lazy_attributes(__name__, globals(), {"KVStore": "store"}, frozenset(["disk"]))
    # mmkv.cache.KVStore imports mmkv.cache.store on first use; mmkv.cache.disk imports that submodule
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, namespace: dict[str, Any], names: Mapping[str, str], submodules: frozenset[str]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names[name]`` is the submodule defining public ``name``;
    ``submodules`` are imported whole. The value found is kept in ``namespace`` (the package's globals), so each
    is imported once; any other name raises ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(f".{names[name]}", package), name)
        elif name in submodules:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__
