"""The shipped small checkpoints: load by name through the real-checkpoint path, size bound, exact round trip;
and the training step itself on a fresh small model."""

from __future__ import annotations

import pytest
import torch

import mmkv
from evals.tasks import TRAINING_CATEGORIES, iter_samples, sample_session
from mmkv.model.registry import SHIPPED, SHIPPED_DIR
from training.data import collate, encode_sample
from training.model import build_model

pytestmark = pytest.mark.shipped


def _round_trip(handle: mmkv.ModelHandle, tmp_path) -> None:
    """Save ``handle``, load it by directory, and require the same fingerprint and the same logits (to 1e-6: the
    weights are bit-identical, but the loaded Qwen2.5-VL can pick other float32 kernels, 1.2e-7 apart)."""
    again = mmkv.load(handle.save(tmp_path / "copy"), device="cpu")
    assert again.fingerprint == handle.fingerprint
    sample = next(iter_samples("trajectory", 0, "heldout"))
    logits = [
        sample_session(h, sample, reuse="none").next_token_logits(sample.question) for h in (handle, again)
    ]
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_small_architecture_fits_the_size_bound_and_round_trips(family, tmp_path):
    """A fresh small model of each family weighs <= 25 MB on disk and loads back exactly by directory."""
    handle = build_model(family)
    _round_trip(handle, tmp_path)
    weights = sum(f.stat().st_size for f in (tmp_path / "copy").glob("*.safetensors"))
    assert 0 < weights <= 25 * 2**20


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoint_loads_by_name_and_round_trips(name, tmp_path):
    """A shipped small-* checkpoint loads by name from checkpoints/ and round-trips exactly."""
    directory = SHIPPED_DIR / SHIPPED[name]
    if not (directory / "config.json").is_file():
        pytest.skip(f"{name} is not trained yet: python training/train_small.py (see README, issue 4)")
    _round_trip(mmkv.load(name, device="cpu"), tmp_path)


def test_a_training_step_lowers_the_loss_on_its_batch():
    """Two optimiser steps on one batch of every category (a text-only one included) lower that batch's
    answer-only loss."""
    handle = build_model("qwen3_vl")
    model = handle.model.train()
    batch = [encode_sample(handle, next(iter_samples(c, 5, "train"))) for c in TRAINING_CATEGORIES]
    assert "pixel_values" not in batch[-1]  # agentic_text: the gate said in words
    inputs = collate(handle, batch)
    assert int(inputs["image_grid_thw"].shape[0]) == sum(int(b["grid"].shape[0]) for b in batch[:-1])
    assert int((inputs["labels"] != -100).sum()) == sum(int((b["labels"] != -100).sum()) for b in batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(3):
        loss = model(**inputs).loss
        model.model.rope_deltas = None
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0]
