"""Shared fixtures and helpers: tiny random-weight models of every family, seeded images and token layouts."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from PIL import Image

import mmkv
from mmkv.model.families import family_named
from mmkv.model.registry import TINY

# Servers run in this process (tests/serve/conftest.py: InProcessServer): their model worker, their event loop
# and the test's client take turns at the GIL; a shorter switch interval than Python's 5 ms lets a streamed
# token reach the client without waiting out a whole interval behind the model thread (fewer seconds, same
# answers).
sys.setswitchinterval(0.0005)

FAMILY_MODELS = ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm-4.1v", "tiny-glm-4.5v"]


# the tiny models of families whose tool-call format mmkv reads (Family.tool_format)
TOOL_FAMILY_MODELS = [m for m in FAMILY_MODELS if family_named(TINY[m]).tool_format is not None]


@pytest.fixture(scope="session", params=FAMILY_MODELS)
def tiny(request) -> mmkv.ModelHandle:
    """A tiny model of each family (float32, CPU), built once per test session."""
    return mmkv.load(request.param, device="cpu")


@pytest.fixture(scope="session", params=TOOL_FAMILY_MODELS)
def tool_tiny(request) -> mmkv.ModelHandle:
    """A tiny model of each family with a tool-call format (the others refuse tools: tests/model/families)."""
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


def family_rotary(handle):
    """``(rotary embedding, layout)`` of a loaded model."""
    return handle.model.model.language_model.rotary_emb, handle.rotary


def real_size_rotaries(handle) -> list[tuple[str, object, object]]:
    """``(arch, rotary embedding, layout)`` at each released size of ``handle``'s family (its reference configs),
    the rotary class the model's own; the layout from the config alone, as a checkpoint would give it."""
    from mmkv.model.reference import reference_config
    from mmkv.mrope import rotary_layout_from_config

    rotary_class = type(handle.model.model.language_model.rotary_emb)
    out = []
    for arch in handle.family.references:
        config = reference_config(arch).text_config
        family = handle.family
        layout = rotary_layout_from_config(
            config, family.rotary_kind, pairing=family.rotary_pairing, default_section=family.default_section,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        )  # fmt: skip
        out.append((arch, rotary_class(config), layout))
    return out


# pyproject's markers of the slow groups
SLOW_GROUPS = ("browser", "redis", "training", "frameworks", "shipped", "server", "bench", "gateway")


def pytest_collection_modifyitems(items) -> None:
    """Mark every test of a slow group ``slow`` as well, so ``-m "not slow"`` selects the quick subset."""
    for item in items:
        if any(item.get_closest_marker(group) for group in SLOW_GROUPS):
            item.add_marker(pytest.mark.slow)
