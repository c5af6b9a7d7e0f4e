"""Shared fixtures for the demo's tests: a demo backend on the tiny Qwen3-VL model and example screenshots."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import demo
from app.backend import DemoBackend

REPO = Path(__file__).resolve().parents[2]
SCREEN_1, SCREEN_2 = REPO / "app/examples/screen_1.png", REPO / "app/examples/screen_2.png"
MAX_PIXELS = 120_000  # the backends' upload bound: the 320x224 examples fit, a 400x400 image does not
NEW_TOKENS = 4  # answer length in the tests (the answers' content is noise on the tiny model)


@pytest.fixture(autouse=True)
def short_answers(monkeypatch):
    """The demo's handlers decode ``NEW_TOKENS`` tokens, as ``TurnSettings(max_new_tokens=NEW_TOKENS)`` does."""
    monkeypatch.setattr(demo, "MAX_NEW_TOKENS", NEW_TOKENS)


@pytest.fixture
def backend() -> DemoBackend:
    """A fresh backend (own in-memory stores) on tiny-qwen3-vl, refusing images over ``MAX_PIXELS``."""
    return DemoBackend("tiny-qwen3-vl", max_image_pixels=MAX_PIXELS, device="cpu")
