"""split_prompt / layout_positions against the processor's token ids and the model's get_rope_index."""

from __future__ import annotations

import pytest
import torch

from mmkv.prompt import layout_positions, split_prompt
from tests.conftest import random_image


def _conversation(handle):
    """A two-turn conversation with three images (one shown twice) and its processor inputs."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A screen."},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}],
        },
    ]
    patch = handle.processor.patch_size
    images = [random_image(0, (4, 6), patch), random_image(1, (8, 2), patch), random_image(0, (4, 6), patch)]
    return handle.processor(handle.processor.apply_chat_template(messages), images)


def test_pieces_concatenate_to_the_processor_ids(tiny):
    """Text and image pieces alternate as in the prompt and concatenate back to the processor's ids."""
    inputs = _conversation(tiny)
    pieces = split_prompt(tiny, inputs["input_ids"], inputs["image_grid_thw"])
    assert [p.kind for p in pieces] == ["text", "image", "text", "image", "image", "text"]
    assert [p.prompt_image for p in pieces if p.kind == "image"] == [0, 1, 2]
    ids = inputs["input_ids"][0]
    assert [p.begin for p in pieces] == [0] + [p.end for p in pieces[:-1]] and pieces[-1].end == len(ids)


def test_layout_positions_equal_get_rope_index(tiny):
    """Positions laid out piece by piece equal the model's own get_rope_index for the whole prompt."""
    inputs = _conversation(tiny)
    pieces = split_prompt(tiny, inputs["input_ids"], inputs["image_grid_thw"])
    reference, _ = tiny.model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    assert torch.equal(torch.cat(layout_positions(tiny, pieces), dim=1), reference[:, 0])


def test_mismatched_grids_raise(tiny):
    """Too few grids, too many grids, or a grid of another size raise ValueError."""
    inputs = _conversation(tiny)
    ids, grids = inputs["input_ids"], inputs["image_grid_thw"]
    with pytest.raises(ValueError, match="more images"):
        split_prompt(tiny, ids, grids[:2])
    with pytest.raises(ValueError, match="3 images but 4"):
        split_prompt(tiny, ids, torch.cat([grids, grids[:1]]))
    with pytest.raises(ValueError, match="expected"):
        split_prompt(tiny, ids, torch.tensor([[1, 8, 8], *grids[1:].tolist()]))
