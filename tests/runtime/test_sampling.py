"""Sampling and LogitRules: every valid setting chooses a token (no inf, nan or empty nucleus), settings out of
range are refused when made, and each logit rule changes exactly the scores it names."""

from __future__ import annotations

import pytest
import torch

from mmkv.runtime import LogitRules, Sampling
from mmkv.runtime.sampling import choose


@pytest.mark.parametrize(
    "sampling",
    [Sampling(1e-38), Sampling(1e-30, 0.5, seed=3), Sampling(1.0, 1e-300, seed=0), Sampling(100.0, 1.0, seed=1),
     Sampling(0.7, 0.9, seed=2**64 - 1), Sampling(0.7, 0.9, seed=-(2**63))],
)  # fmt: skip
def test_sampling_never_fails_at_the_edges_of_its_ranges(sampling):
    """Tiny temperatures, a tiny top_p and the extreme seeds choose a token (the most likely one where the
    distribution collapses onto it) instead of raising (inf/nan probabilities, an empty nucleus, overflow)."""
    logits = torch.tensor([0.0, 5.0, -float("inf"), 4.999, 1e4 if sampling.temperature > 50 else 2.0])
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    token = choose(logits, sampling, generator)
    assert token != 2
    if sampling.temperature < 1e-20 or sampling.top_p < 1e-100:
        assert token == int(logits.argmax())


@pytest.mark.parametrize("bad", [{"seed": 2**64}, {"seed": -(2**63) - 1}, {"temperature": -1}, {"top_p": 0}])
def test_sampling_out_of_range_is_a_clear_value_error(bad):
    """Seeds outside what torch takes and out-of-range settings are refused when the Sampling is made."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        Sampling(**{"temperature": 0.7, **bad})


def test_top_k_one_and_a_collapsed_nucleus_are_the_most_likely_token_for_every_seed():
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        assert choose(logits, Sampling(1.0, top_k=1, seed=seed), generator) == 1
        assert choose(logits, Sampling(1.0, top_p=1e-9, seed=seed), generator) == 1
    picked = {
        choose(logits, Sampling(5.0, top_k=2, seed=s), torch.Generator().manual_seed(s)) for s in range(60)
    }
    assert picked == {1, 2}  # the two most likely, both reached at a high temperature


def test_each_logit_rule_changes_exactly_what_it_names_and_not_its_input():
    """Repetition: seen tokens (prompt or answer) divided by p when positive, multiplied when negative;
    presence and frequency: subtracted once and per occurrence from generated tokens; bias added; ids past the
    vocabulary ignored; the input tensor unchanged; neutral rules return it as it is."""
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0])
    kept = logits.clone()
    assert LogitRules().apply(logits, [1, 2], [0]) is logits
    repeated = LogitRules(repetition_penalty=2.0).apply(logits, generated=[1], prompt_ids=[0, 99])
    assert repeated.tolist() == [1.0, -4.0, 1.0, 0.5, -1.0]
    counted = LogitRules(presence_penalty=0.5, frequency_penalty=0.25).apply(logits, [2, 2, 3, 99], [0])
    assert counted.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, -1.0]
    biased = LogitRules(logit_bias=((4, 100.0), (7, -5.0))).apply(logits, [], [])
    assert biased.tolist() == [2.0, -2.0, 1.0, 0.5, 99.0]
    assert torch.equal(logits, kept)


@pytest.mark.parametrize(
    "bad, named",
    [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": True}, "frequency_penalty"),
     ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": float("nan")}, "repetition_penalty"),
     ({"logit_bias": ((-1, 1.0),)}, "logit_bias keys"), ({"logit_bias": ((3, 101.0),)}, "logit_bias values"),
     ({"logit_bias": ((3, "1"),)}, "logit_bias values")],
)  # fmt: skip
def test_logit_rules_out_of_range_are_a_clear_value_error(bad, named):
    with pytest.raises(ValueError, match=named):
        LogitRules(**bad)
