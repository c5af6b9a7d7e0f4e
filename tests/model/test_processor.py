"""The image-only processor: chat template, pad expansion, token types."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_image


def test_pads_expand_per_image_in_order(tiny):
    """The i-th image placeholder becomes grid_i.prod() // 4 pads, wrapped by its vision markers."""
    proc = tiny.processor
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}
    ]
    text = proc.apply_chat_template(messages)
    tokens = tiny.family.tokens
    assert text.count(tokens.start + tokens.pad + tokens.end) == 2
    generation = text.removeprefix(proc.apply_chat_template(messages, add_generation_prompt=False))
    assert "assistant" in generation and generation.endswith("\n")
    images = [random_image(0, (4, 6), proc.patch_size), random_image(1, (8, 2), proc.patch_size)]
    inputs = proc(text, images)
    ids = inputs["input_ids"][0]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 2]]
    pad_runs = [
        int(n)
        for n in torch.unique_consecutive(ids == proc.image_token_id, return_counts=True)[1][
            torch.unique_consecutive(ids == proc.image_token_id)
        ]
    ]
    assert pad_runs == [6, 4]
    assert torch.equal(inputs["mm_token_type_ids"][0], (ids == proc.image_token_id).int())
    starts = (ids == proc.vision_start_token_id).nonzero().flatten()
    assert ids[starts + 1].tolist() == [proc.image_token_id] * 2


def test_placeholder_and_image_counts_must_agree(tiny):
    """More placeholders than images, or placeholders without images, raise ValueError."""
    proc = tiny.processor
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}])
    with pytest.raises(ValueError, match="2 image placeholders but 1"):
        proc(text, [random_image(0, (4, 4), proc.patch_size)])
    with pytest.raises(ValueError, match="no images"):
        proc(text)


def test_large_images_are_resized_within_the_pixel_bound(tiny):
    """An image far over max_pixels is resized so grid * patch^2 stays within the bound."""
    proc = tiny.processor
    grid = proc.preprocess_images([random_image(0, (60, 90), proc.patch_size)]).image_grid_thw[0]
    assert int(grid[1] * grid[2]) * proc.patch_size**2 <= proc.pixel_bounds[1]


@pytest.mark.parametrize("size", [(37, 211), (640, 480), (1000, 20), (57, 57)])
def test_image_grid_from_size_equals_the_preprocessed_grid(tiny, size):
    """image_grid (size only) equals the grid preprocess_images reports for odd, large, thin and small images."""
    image = random_image(1, (1, 1), 1).resize(size)
    assert (
        list(tiny.processor.image_grid(image))
        == tiny.processor.preprocess_images([image]).image_grid_thw[0].tolist()
    )
