"""Training examples: suite samples (answer-only labels) and tool-using desktop episodes (tool-call labels).

- ``encode_sample``: a suite sample rendered by an ``mmkv.Session`` (exactly as the VQA eval and the demo render
  it), the label the answer and ``<|im_end|>``.
- ``encode_episode_step``: the message list an agent resends before call ``k`` of an expert episode
  (``Episode.messages``: the window of the last screenshots, in tool or in user messages), followed by call
  ``k`` itself, rendered through the stock path (``processor.apply_chat_template(messages, tools=...)``, pads
  expanded, tokenised with the images). Labels are the assistant tool calls, each exactly as the chat template
  renders one: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>``. Besides call ``k``,
  every earlier call whose own screenshot is still in the window is labelled too (its decision was made on a
  screen the prompt still shows), so one sequence teaches up to ``window`` steps.
- ``collate``: right-padded batches for the model's own forward (it computes the M-RoPE positions).
"""

from __future__ import annotations

import random

import torch

from evals.sample import Sample
from evals.tasks import sample_session
from mmkv.envs import Episode, hermes_text, message_images
from mmkv.model.handle import ModelHandle

__all__ = ["collate", "encode_episode_step", "encode_sample", "supervised_calls"]

ASSISTANT_HEADER = "<|im_start|>assistant\n"


def encode_sample(
    handle: ModelHandle, sample: Sample, dense: int = 0, rng: random.Random | None = None
) -> dict[str, torch.Tensor]:
    """Token ids ``(L,)``, labels ``(L,)`` (the answers only) and pixels of one suite sample.

    ``dense`` > 0 asks up to that many more of the questions the same turns answer (``Sample.also``, drawn with
    ``rng``) as a chat would: each asked and answered in turn, the sample's own question at a random place among
    them, every answer labelled (its text and ``<|im_end|>``). One forward then teaches several reads of the same
    pictures, as a user asking a session several questions does (the demo's trajectory). ``dense`` 0 gives the
    eval's prompt: the conversation and the one question."""
    pairs = [(sample.question, sample.answer)]
    if dense and sample.also:
        rng = rng or random.Random(sample.digest)
        pairs += rng.sample(list(sample.also), min(dense, len(sample.also)))
        rng.shuffle(pairs)
    session = sample_session(handle, sample)
    for question, answer in pairs[:-1]:
        session.add_text(question, role="user")
        session.add_text(answer, role="assistant")
    prompt, order = session.render(pairs[-1][0])
    answer = torch.tensor(handle.processor.encode_text(pairs[-1][1] + "<|im_end|>"), dtype=torch.long)
    ids = torch.cat([prompt, answer])
    labels = torch.cat([torch.full_like(prompt, -100), answer])
    _label_earlier_answers(handle, ids, labels, len(pairs) - 1)
    example = {"ids": ids, "labels": labels}
    if order:  # text-only samples (the agentic task's text gate) have no pixels
        images = handle.processor.preprocess_images([session.images[i].pixels for i in order])
        example |= {"pixel_values": images.pixel_values, "grid": images.image_grid_thw}
    return example


def _answer_starts(handle: ModelHandle, flat: list[int]) -> list[int]:
    """Where each assistant turn's content begins in the token ids ``flat`` (just after its header)."""
    header = handle.processor.encode_text(ASSISTANT_HEADER)
    return [
        i + len(header)
        for i in range(len(flat) - len(header) + 1)
        if flat[i] == header[0] and flat[i : i + len(header)] == header
    ]


def _label_earlier_answers(handle: ModelHandle, ids: torch.Tensor, labels: torch.Tensor, count: int) -> None:
    """Copy into ``labels`` the first ``count`` assistant answers of ``ids`` (each from after its header up to
    and including its ``<|im_end|>``). Changes ``labels`` only. Raises ``AssertionError`` if the prompt holds
    fewer answers."""
    if not count:
        return
    flat, end = ids.tolist(), handle.processor.encode_text("<|im_end|>")[0]
    starts = _answer_starts(handle, flat)
    assert len(starts) >= count, f"found {len(starts)} assistant turns, expected {count} answered"
    for start in starts[:count]:
        stop = flat.index(end, start) + 1
        labels[start:stop] = ids[start:stop]


def supervised_calls(k: int, window: int) -> range:
    """The calls labelled in the sequence that ends with call ``k``: those whose screenshot (the ``j``-th, shown
    before call ``j``) is among the last ``window`` of the prompt before call ``k``.

    >>> list(supervised_calls(5, 3)), list(supervised_calls(1, 3))
    ([3, 4, 5], [0, 1])
    """
    return range(max(0, k + 1 - window), k + 1)


def encode_episode_step(
    handle: ModelHandle, episode: Episode, k: int, screenshot_in: str = "tool", window: int = 3
) -> dict[str, torch.Tensor]:
    """Token ids ``(L,)``, labels ``(L,)`` (the supervised tool calls) and pixels of the prompt before call ``k``
    of ``episode`` with call ``k`` appended. Raises ``AssertionError`` if a labelled span is not the call's
    own rendering (the template and the tokenizer must agree on it)."""
    processor = handle.processor
    messages = episode.messages(k, screenshot_in=screenshot_in, window=window, as_url=False)
    messages.append(
        {"role": "assistant", "content": None, "tool_calls": [episode.steps[k].call.to_openai(f"call_{k}")]}
    )
    text = processor.apply_chat_template(messages, add_generation_prompt=False, tools=episode.tools)
    inputs = processor(text, message_images(messages))
    ids = inputs["input_ids"][0]  # (L,)
    labels = torch.full_like(ids, -100)
    starts = _answer_starts(handle, ids.tolist())
    assert len(starts) == k + 1, f"found {len(starts)} assistant turns, expected {k + 1}"
    for j in supervised_calls(k, window):
        target = processor.encode_text(hermes_text(episode.steps[j].call) + "<|im_end|>")
        span = ids[starts[j] : starts[j] + len(target)]
        assert span.tolist() == target, f"call {j} is not rendered as its hermes text"
        labels[starts[j] : starts[j] + len(target)] = span
    example = {"ids": ids, "labels": labels}
    if "pixel_values" in inputs:
        example |= {"pixel_values": inputs["pixel_values"], "grid": inputs["image_grid_thw"]}
    return example


def collate(handle: ModelHandle, batch: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch inputs for the model's own forward (it computes M-RoPE positions itself)."""
    length = max(int(b["ids"].shape[0]) for b in batch)
    pad = handle.tokenizer.pad_token_id
    ids = torch.full((len(batch), length), pad, dtype=torch.long)  # (B, L)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(batch), length), dtype=torch.long)  # (B, L)
    for row, b in enumerate(batch):
        n = int(b["ids"].shape[0])
        ids[row, :n], labels[row, :n], mask[row, :n] = b["ids"], b["labels"], 1
    inputs = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "mm_token_type_ids": (ids == handle.processor.image_token_id).int(),
    }
    with_images = [b for b in batch if "grid" in b]
    if with_images:
        inputs["pixel_values"] = torch.cat([b["pixel_values"] for b in with_images])
        inputs["image_grid_thw"] = torch.cat([b["grid"] for b in with_images])
    return inputs
