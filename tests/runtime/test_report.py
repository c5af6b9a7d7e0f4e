"""The turn's report records: repair fractions guarded at zero and exact otherwise, and an answer's counts read
off its prefill, adding up to the prompt on a real turn, with one entry per image naming a known origin."""

from __future__ import annotations

import typing

import mmkv
from mmkv.cache.store import StoreTier
from mmkv.runtime import KVOrigin, RepairStats
from tests.conftest import random_image


def test_repair_fractions_are_zero_with_nothing_placed_and_exact_otherwise():
    assert RepairStats().fraction == 0.0 == RepairStats().image_fraction
    stats = RepairStats(placed=12, recomputed=5, image_tokens=6, image_recomputed=2)
    assert stats.fraction == 5 / 12 and stats.image_fraction == 2 / 6


def test_an_answer_s_counts_add_up_to_its_prompt_and_name_each_image_s_origin(tiny):
    """A cold turn computes everything; the next turn reuses the live prefix; either way prefilled + reused is
    the prompt, the answer's properties are its prefill's, and each image's origin is one of KVOrigin's."""
    origins = set(typing.get_args(typing.get_args(KVOrigin)[0])) | set(typing.get_args(StoreTier))
    session = mmkv.Session(tiny, reuse="kv")
    session.add_image(random_image(8, (4, 4), tiny.processor.patch_size))
    for question, cold in (("What is it?", True), ("And the colour?", False)):
        answer = session.ask(question, max_new_tokens=2)
        prefill = answer.prefill
        assert (answer.prompt_tokens, answer.prefilled_tokens, answer.reused_tokens, answer.images) == (
            prefill.prompt_tokens, prefill.prefilled, prefill.reused, prefill.images,
        )  # fmt: skip
        assert (
            prefill.prefilled + prefill.reused == prefill.prompt_tokens == session.last_prefill.prompt_tokens
        )
        assert len(answer.images) == 1 and answer.images[0].source in origins
        assert (prefill.reused == 0) == cold and answer.images[0].source == ("computed" if cold else "live")
