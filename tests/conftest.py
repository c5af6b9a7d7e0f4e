"""Shared fixtures: tiny random-weight models of both families, seeded images and token layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import mmkv

FAMILY_MODELS = ["tiny-qwen2.5-vl", "tiny-qwen3-vl"]


@pytest.fixture(scope="session", params=FAMILY_MODELS)
def tiny(request) -> mmkv.ModelHandle:
    """A tiny model of each family (float32, CPU), built once per test session."""
    return mmkv.load(request.param, device="cpu")


@pytest.fixture(scope="session")
def tiny_by_name() -> dict[str, mmkv.ModelHandle]:
    """Both tiny models by name, for tests that compare families."""
    return {name: mmkv.load(name, device="cpu") for name in FAMILY_MODELS}


def random_image(seed: int, grid_hw: tuple[int, int], patch: int) -> Image.Image:
    """An RGB noise image sized so the processor keeps it at vision grid ``grid_hw`` exactly."""
    rng = np.random.default_rng(seed)
    h, w = grid_hw[0] * patch, grid_hw[1] * patch
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), "RGB")


def random_text_ids(handle: mmkv.ModelHandle, rng: np.random.Generator, length: int) -> torch.Tensor:
    """``length`` random ordinary (non-special) token ids."""
    first_ordinary = len(handle.family.special_tokens)  # the tiny tokenizers put the special tokens first
    return torch.as_tensor(rng.integers(first_ordinary, len(handle.tokenizer), size=length), dtype=torch.long)


# pyproject's markers of the slow groups
SLOW_GROUPS = ("browser", "redis", "training", "frameworks", "shipped", "server", "bench", "gateway")


def pytest_collection_modifyitems(items) -> None:
    """Mark every test of a slow group ``slow`` as well, so ``-m "not slow"`` selects the quick subset."""
    for item in items:
        if any(item.get_closest_marker(group) for group in SLOW_GROUPS):
            item.add_marker(pytest.mark.slow)
