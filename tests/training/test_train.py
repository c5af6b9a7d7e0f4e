"""Training on tool-using episodes: the labels are exactly the hermes tool calls, the prompts are the eval's,
the images are 64 tokens, a few steps lower the loss, and a step-bounded run writes its snapshots and report."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

import mmkv
from evals.episodes import step_inputs
from evals.tasks import make_samples, sample_session
from mmkv.envs import expert_episode, hermes_text
from mmkv.model.families.qwen_template import TOOLS_INSTRUCTION
from mmkv.model.registry import SHIPPED, SHIPPED_DIR
from training.data import collate, encode_episode_step, encode_sample, supervised_calls
from training.model import IMAGE_BOUNDS, load_for_training
from training.train_small import train

pytestmark = pytest.mark.training


@pytest.fixture(scope="module", params=sorted(SHIPPED))
def handle(request):
    """A shipped checkpoint as training continues it (tool template, 256 px bounds)."""
    directory = SHIPPED_DIR / SHIPPED[request.param]
    if not (directory / "config.json").is_file():
        pytest.skip(f"{request.param} is not trained yet")
    return load_for_training(directory)


def test_pictures_are_64_tokens_and_the_template_renders_tools(handle):
    """Suite pictures and desktop screens are 8 x 8 language-model tokens in both families; the chat
    template lists tools with the released hermes instruction."""
    assert handle.processor.pixel_bounds == IMAGE_BOUNDS[handle.family.name]
    pictures = [make_samples("multihop", 1)[0].images[0], expert_episode(0).first_image]
    for picture in pictures:
        assert handle.processor.num_image_tokens(handle.processor.image_grid(picture)) == 64
    episode = expert_episode(0)
    text = handle.processor.apply_chat_template(episode.messages(0), True, tools=episode.tools)
    assert TOOLS_INSTRUCTION in text and '"name": "click"' in text


@pytest.mark.parametrize("screenshot_in", ["tool", "user"])
def test_labels_are_exactly_the_supervised_tool_calls(handle, screenshot_in):
    """Every labelled token belongs to a supervised call's hermes text + <|im_end|>; their count is the sum of
    those texts' lengths; the prompt before call k is token for token the eval's prompt (stock path)."""
    episode = expert_episode(4)
    processor = handle.processor
    for k in range(len(episode.steps)):
        example = encode_episode_step(handle, episode, k, screenshot_in, window=3)
        calls = [
            processor.encode_text(hermes_text(episode.steps[j].call) + "<|im_end|>")
            for j in supervised_calls(k, 3)
        ]
        labelled = example["labels"][example["labels"] != -100].tolist()
        assert labelled == [t for call in calls for t in call]
        prompt = step_inputs(
            processor, episode.messages(k, screenshot_in=screenshot_in, as_url=False), episode.tools
        )
        n = prompt["input_ids"].shape[1]
        assert torch.equal(example["ids"][:n], prompt["input_ids"][0]) and example["labels"][n - 1] == -100
        assert len(example["ids"]) < 0.6 * handle.max_positions  # a 10-step episode: about 2,100 tokens


def test_a_few_steps_lower_the_tool_call_loss(handle):
    """Each of three optimiser steps on one batch of episode steps lowers that batch's tool-call loss (on a
    copy: the fixture stays as loaded). The rate is small because the shipped weights already fit these
    training episodes (loss ~1e-3): Adam's first steps at 1e-3 overshoot a fitted minimum."""
    model = copy.deepcopy(handle.model).train()
    batch = [encode_episode_step(handle, expert_episode(s), 1, "tool", 3) for s in (1, 2)]
    inputs = collate(handle, batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(3):
        loss = model(**inputs).loss
        model.model.rope_deltas = None
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[2] < losses[1] < losses[0], losses


def test_a_bounded_run_writes_snapshots_progress_and_report(tmp_path):
    """Two steps from the shipped Qwen3-VL weights, a snapshot after each: progress.jsonl holds the start, the
    snapshot and the final evaluation; step-000001 and the run directory itself load through mmkv.load with the
    tool template and the new image bounds."""
    init = SHIPPED_DIR / SHIPPED["small-qwen3-vl"]
    if not (init / "config.json").is_file():
        pytest.skip("small-qwen3-vl is not trained yet")
    report = train("qwen3_vl", tmp_path, init=init, steps=2, batch_size=2, tool_batch=1, checkpoint_every=1,
                   snapshot_n=1, snapshot_episodes=1, eval_n=2)  # fmt: skip
    lines = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[-1]["final"]
    assert all(
        0 <= line["tools_quick"]["step_accuracy"] <= 1 and "multihop" in line["heldout_quick"]
        for line in lines
    )
    assert report["steps_done"] == 2 and report["stopped_by"] == "steps" and report["total_steps"] > 2
    for directory in (tmp_path / "step-000001", tmp_path):
        loaded = mmkv.load(directory)
        assert loaded.processor.pixel_bounds == IMAGE_BOUNDS["qwen3_vl"]
        assert "tool_call" in loaded.processor.chat_template
    assert lines[-1]["eval_n"] == 2 and lines[-1]["tools_quick"]["steps"] >= 4  # eval_n // 4 -> one episode


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen2.5-vl"])
def test_tool_tokens_leave_the_suite_and_the_old_logits_unchanged(name):
    """Growing a tokenizer without them (the tiny models': as the pre-tool checkpoints were) by the tool tokens:
    each is one new token after the old ids (the hermes tags as in the released tokenizers); every suite text
    tokenises as before; the grown model's logits over the old vocabulary are the old model's; growing again
    adds nothing."""
    import copy

    from evals.tasks import TRAINING_CATEGORIES, sample_session
    from training.model import TOOL_TOKENS, add_tool_tokens, with_current_processor

    shipped = mmkv.load(name)
    grown = mmkv.ModelHandle.from_parts(name, copy.deepcopy(shipped.model),
                                        copy.deepcopy(shipped.processor), shipped.family)  # fmt: skip
    grown = with_current_processor(grown)
    old, new = shipped.tokenizer, grown.tokenizer
    assert len(new) == len(old) + len(TOOL_TOKENS)
    assert new("<tool_call>", add_special_tokens=False)["input_ids"] == [
        new.convert_tokens_to_ids("<tool_call>")
    ]
    assert all(new.convert_tokens_to_ids(t) >= len(old) for t in TOOL_TOKENS)
    for category in TRAINING_CATEGORIES:
        for s in make_samples(category, 10, split="train"):
            for text in (s.system, s.question, s.answer, *(t.text for t in s.turns)):
                assert (
                    old(text, add_special_tokens=False)["input_ids"]
                    == new(text, add_special_tokens=False)["input_ids"]
                )
    sample = make_samples("agentic_text", 1)[0]
    before = sample_session(shipped, sample, reuse="none").next_token_logits(sample.question)  # (V,)
    after = sample_session(grown, sample, reuse="none").next_token_logits(sample.question)  # (V + tools,)
    assert (before - after[: len(old)]).abs().max() < 1e-4
    assert add_tool_tokens(new, grown.model) == 0


def test_the_shipped_checkpoints_hold_the_tool_tokens(handle):
    """The retrained checkpoints already hold every tool token as one token: continuing them adds none."""
    from training.model import TOOL_TOKENS, add_tool_tokens

    tokenizer = handle.tokenizer
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 1 for t in TOOL_TOKENS)
    assert add_tool_tokens(tokenizer, handle.model) == 0


@pytest.mark.parametrize("category", ["trajectory", "multihop", "perception"])
def test_dense_labels_are_exactly_the_answers_asked(handle, category):
    """A dense example asks the sample's question among ``dense`` others it answers (``Sample.also``), each
    answered in turn: the labelled tokens are exactly those answers + ``<|im_end|>``, in the order asked, and
    ``dense=0`` is the eval's prompt (the session's render of the one question) with only its answer labelled."""
    processor = handle.processor
    for sample in make_samples(category, 4, seed=3, split="train"):
        plain = encode_sample(handle, sample)
        prompt, _ = sample_session(handle, sample).render(sample.question)
        assert torch.equal(plain["ids"][: len(prompt)], prompt)
        assert plain["labels"][plain["labels"] != -100].tolist() == processor.encode_text(
            sample.answer + "<|im_end|>"
        )
        dense = encode_sample(handle, sample, dense=3, rng=random.Random(1))
        text = processor.tokenizer.decode(dense["ids"])
        asked = [(q, a) for q, a in [(sample.question, sample.answer), *sample.also] if q in text]
        assert len(asked) == min(4, 1 + len(sample.also))
        asked.sort(key=lambda pair: text.index(pair[0]))
        expected = [t for _, a in asked for t in processor.encode_text(a + "<|im_end|>")]
        assert dense["labels"][dense["labels"] != -100].tolist() == expected
        assert torch.equal(dense["pixel_values"], plain["pixel_values"])
