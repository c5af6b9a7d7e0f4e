"""The position rule against the models' own ``get_rope_index``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmkv.mrope import (
    ImageSpan,
    PositionRule,
    TextSpan,
    image_positions,
    image_slots,
    llm_grid,
    sequence_positions,
)
from tests.conftest import random_text_ids


def test_worked_example_of_the_docstring():
    """Two text tokens, a (1, 4, 6) image and a text token give the documented ids and next position 5."""
    positions, next_position = sequence_positions([TextSpan(2), ImageSpan((1, 4, 6)), TextSpan(1)])
    expected = torch.tensor(
        [
            [0, 1, 2, 2, 2, 2, 2, 2, 5],
            [0, 1, 2, 2, 2, 3, 3, 3, 5],
            [0, 1, 2, 3, 4, 2, 3, 4, 5],
        ]
    )
    assert torch.equal(positions, expected)
    assert next_position == 6 - 0  # 2 text + 3 image slots + 1 text


def test_image_positions_example_and_slots():
    """An image at 4 of LLM grid 2 x 3: T [4]*6, H [4,4,4,5,5,5], W [4,5,6,4,5,6]; 3 slots, 6 pads."""
    ids = image_positions(4, (1, 4, 6))
    assert ids.tolist() == [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6, 4, 5, 6]]
    assert image_slots((1, 4, 6)) == 3
    assert image_slots((1, 10, 2)) == 5
    assert PositionRule(2).num_image_tokens((1, 10, 2)) == 5


@pytest.mark.parametrize("grid", [(2, 4, 4), (1, 3, 4), (1, 0, 4), (1, 4)])
def test_llm_grid_rejects_videos_odd_and_malformed_grids(grid):
    """Video grids, grids not divisible by the merge size, empty and malformed grids raise ValueError."""
    with pytest.raises(ValueError):
        llm_grid(grid, 2)


def _random_layout(rng: np.random.Generator) -> list[TextSpan | ImageSpan]:
    """1-4 images of random non-square grids, each wrapped in its vision markers, between free text runs
    of random length (zero included). The markers are text: they add one token to each neighbouring run."""
    free_text = [int(rng.integers(0, 6))]
    grids = []
    for _ in range(int(rng.integers(1, 5))):
        grids.append((1, 2 * int(rng.integers(1, 8)), 2 * int(rng.integers(1, 8))))
        free_text.append(int(rng.integers(0, 6)))
    spans: list[TextSpan | ImageSpan] = []
    for i, grid in enumerate(grids):
        before = free_text[i] + 1 + (1 if i else 0)  # free text, <|vision_start|>, previous <|vision_end|>
        spans += [TextSpan(before), ImageSpan(grid)]
    spans.append(TextSpan(free_text[-1] + 1))  # last <|vision_end|>, free text
    return spans


def _token_ids(handle, spans, rng) -> torch.Tensor:
    """Ids for ``spans``: random text whose runs end/start with the vision markers around each image."""
    proc = handle.processor
    parts = []
    for i, span in enumerate(spans):
        if isinstance(span, TextSpan):
            ids = random_text_ids(handle, rng, span.length)
            if i > 0:
                ids[0] = proc.vision_end_token_id
            if i + 1 < len(spans):
                ids[-1] = proc.vision_start_token_id
            parts.append(ids)
        else:
            n = handle.position_rule.num_image_tokens(span.grid_thw)
            parts.append(torch.full((n,), proc.image_token_id, dtype=torch.long))
    return torch.cat(parts)


@pytest.mark.parametrize("seed", range(25))
def test_position_rule_equals_get_rope_index(tiny, seed):
    """On random layouts (zero-length free text included) the rule equals the model's own get_rope_index, and rope_deltas match too."""
    rng = np.random.default_rng(seed)
    spans = _random_layout(rng)
    ids = _token_ids(tiny, spans, rng)[None]  # (1, L)
    grids = torch.tensor([s.grid_thw for s in spans if isinstance(s, ImageSpan)])
    reference, rope_deltas = tiny.model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == tiny.processor.image_token_id).int(), image_grid_thw=grids
    )
    ours, next_position = tiny.position_rule.sequence(spans)
    assert torch.equal(ours, reference[:, 0])
    assert next_position - ids.shape[1] == int(rope_deltas)
