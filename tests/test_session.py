"""Session: token ids as the processor makes them, each reuse policy against full recompute, the window."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmkv
import mmkv.prompt
from mmkv.cache import EncoderStore, KVStore
from mmkv.kv import append_to_cache, new_cache, prefill_span
from tests.conftest import random_image
from tests.helpers import full_forward_logits


def _images(handle, n=3):
    patch = handle.processor.patch_size
    grids = [(4, 6), (6, 2), (2, 8), (4, 4)]
    return [random_image(10 + i, grids[i], patch) for i in range(n)]


def _max_abs(a, b) -> float:
    return (a - b).abs().max().item()


def test_rendered_ids_equal_the_processor(tiny):
    """A session's prompt ids equal the processor's chat template + call on the same conversation."""
    session = mmkv.Session(tiny, reuse="none")
    a, b, _ = _images(tiny)
    session.add_text("You are a careful agent.", role="system")
    session.add_image(a)
    session.add_text("What is shown?")
    session.add_text("It is a form.", role="assistant")
    session.add_image(b)
    session.add_text("And now?")
    ids, order = session.render()
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You are a careful agent."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It is a form."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And now?"}]},
    ]
    expected = tiny.processor(tiny.processor.apply_chat_template(messages), [a, b])["input_ids"][0]
    assert order == [0, 1] and torch.equal(ids, expected)


def test_none_and_encoder_equal_the_models_own_forward_over_turns(tiny):
    """Several images at several positions over three turns: reuse="encoder" gives the logits of reuse="none",
    and both those of one full forward (max abs <= 1e-4); encoder hits are reported."""
    a, b, c = _images(tiny)
    sessions = {policy: mmkv.Session(tiny, reuse=policy) for policy in ("none", "encoder")}
    for turn, step in enumerate([[a], [b, a], [c]]):
        for session in sessions.values():
            session.add_text(f"turn {turn}:")
            for image in step:
                session.add_image(image)
        reference = full_forward_logits(tiny, sessions["none"], "Which one?")
        logits = {p: s.next_token_logits("Which one?") for p, s in sessions.items()}
        assert _max_abs(logits["none"], reference) <= 1e-4
        assert _max_abs(logits["encoder"], reference) <= 1e-4
        for session in sessions.values():
            session.add_text("ok", role="assistant")
    answer = sessions["encoder"].ask("Last question?", max_new_tokens=3)
    assert {r.source for r in answer.images} <= {"live", "computed"} and len(answer.images) == 4
    assert {r.encoder for r in answer.images if r.source == "computed"} <= {
        "memory"
    }  # KV recomputed from cache
    assert sessions["encoder"].encoder_store.stats().memory.hits >= 1


def test_kv_after_the_same_preamble_equals_full_recompute(tiny):
    """An image cached in one session and spliced by another right after the same preamble gives the logits
    of full recompute (<= 1e-4), reported as a store hit."""
    store, (image, _, _) = KVStore(), _images(tiny)
    first = mmkv.Session(tiny, store=store)
    first.add_image(image)
    first.ask("Describe it.", max_new_tokens=2)
    second = mmkv.Session(tiny, store=store)
    second.add_image(image)
    logits = second.next_token_logits("What colour dominates?")
    reference = full_forward_logits(tiny, second, "What colour dominates?")
    assert _max_abs(logits, reference) <= 1e-4
    answer = second.ask("What colour dominates?", max_new_tokens=2)
    assert answer.images[0].source in ("memory", "live")


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_moved_image_rerotated_is_closer_than_unrotated(tiny_by_name, name):
    """Cached after a short preamble, reused 60+ positions later after other text: the re-rotated splice is
    closer to full recompute (logit cosine) than the un-rotated one. Not on the tiny GLM models: there both
    stay within 3e-4 of full recompute and of each other at 60-240 positions (0.99836 rotated vs 0.99846 not at
    60), too little position dependence in a random model to show it; their rotation is exact against the
    model's own (tests/mrope)."""
    tiny = tiny_by_name[name]
    store, (image, _, _) = KVStore(), _images(tiny)
    warm = mmkv.Session(tiny, store=store)
    warm.add_image(image)
    warm.next_token_logits("Describe it.")
    cosines = {}
    for rotate in (True, False):
        config = mmkv.SessionConfig.of(reuse="kv", seam=0, rotate=rotate)
        session = mmkv.Session(tiny, store=store, config=config)
        session.add_text(" ".join(["Here is a long history of earlier steps in the task."] * 4))
        session.add_image(image)
        logits = session.next_token_logits("Describe it.")
        reference = full_forward_logits(tiny, session, "Describe it.")
        cosines[rotate] = F.cosine_similarity(logits, reference, dim=0).item()
    assert cosines[True] > cosines[False]


def test_window_rebuild_prefills_only_new_tokens_and_equals_splicing_by_hand(tiny):
    """window=2, a third image arrives and the first leaves: only the new suffix is prefilled (count asserted,
    seam 0) and the logits equal splicing the same cached segments by hand (<= 1e-5)."""
    a, b, c = _images(tiny)
    session = mmkv.Session(tiny, reuse="kv", seam=0, window=2)
    session.add_text("Step one:")
    session.add_image(a)
    session.add_text("click(ok)", role="assistant")
    session.add_text("Step two:")
    session.add_image(b)
    session.next_token_logits("Next?")  # turn 2: everything is prefilled, B is stored
    old = session.live.segment()
    session.add_text("Next?")
    session.add_text("click(next)", role="assistant")
    session.add_text("Step three:")
    session.add_image(c)
    logits = session.next_token_logits("Now?")
    stats = session.last_prefill
    new_ids, order = session.render("Now?")
    assert order == [1, 2] and stats.prompt_tokens == new_ids.shape[0]
    proc, pieces_old = (
        tiny.processor,
        mmkv.prompt.split_prompt(
            tiny, old.token_ids, torch.tensor([session.images[0].grid, session.images[1].grid])
        ),
    )
    a_piece = pieces_old[1]
    a_begin = pieces_old[0].length
    without_a = torch.cat([old.token_ids[:a_begin], old.token_ids[a_begin + a_piece.length :]])
    assert torch.equal(new_ids[: without_a.shape[0]], without_a)
    suffix = new_ids.shape[0] - without_a.shape[0]
    assert stats.prefilled == suffix and stats.reused == without_a.shape[0]
    # by hand: the kept prefix, then every old piece after A moved to its new start, then prefill the suffix
    grids = torch.tensor([session.images[i].grid for i in order])
    new_positions = torch.cat(
        mmkv.prompt.layout_positions(tiny, mmkv.prompt.split_prompt(tiny, new_ids, grids)), 1
    )
    cache = new_cache(tiny)
    append_to_cache(cache, old.slice(0, a_begin))
    rest = old.slice(a_begin + a_piece.length)
    append_to_cache(cache, rest.moved_to(int(new_positions[0, a_begin])))
    images = proc.preprocess_images([c])
    by_hand = prefill_span(
        tiny,
        new_ids[without_a.shape[0] :],
        new_positions[:, without_a.shape[0] :],
        context=cache,
        images=images,
    )
    assert _max_abs(logits, by_hand.logits) <= 1e-5


@pytest.mark.parametrize("seam", [0, 3])
def test_kv_seams_that_recompute_pads_stay_exact_in_the_same_context(tiny, seam):
    """seam 0 (pure splice) and seam 3 (marker + two pads recomputed from cached vision features, DeepStack
    included) are exact too when the context is the one the image was cached in."""
    store, (image, _, _) = KVStore(), _images(tiny)
    warm = mmkv.Session(tiny, store=store)
    warm.add_image(image)
    warm.next_token_logits("Describe it.")
    session = mmkv.Session(tiny, store=store, seam=seam, encoder_store=warm.encoder_store)
    session.add_image(image)
    logits = session.next_token_logits("Describe it.")
    assert _max_abs(logits, full_forward_logits(tiny, session, "Describe it.")) <= 1e-4
    assert session.last_prefill.images[0].source == "memory"
    assert session.last_prefill.prefilled == session.last_prefill.prompt_tokens - (
        session.last_prefill.reused
    )


def test_ask_appends_the_turn_and_reuses_the_live_prefix(tiny):
    """ask returns text and counts, appends question and answer; the next turn keeps the live prefix."""
    session = mmkv.Session(tiny)
    image, _, _ = _images(tiny)
    session.add_image(image)
    first = session.ask("What is it?", max_new_tokens=4)
    assert isinstance(first.text, str) and 1 <= len(first.token_ids) <= 4
    assert first.prefilled_tokens == first.prompt_tokens and first.reused_tokens == 0
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert first.ttft_s <= first.total_s
    second = session.ask("Are you sure?", max_new_tokens=2)
    assert second.reused_tokens >= first.prompt_tokens - 1
    assert second.images[0].source == "live"


def test_bad_images_raise_their_errors_and_leave_the_session_usable(tiny, tmp_path):
    """Each bad input raises its mmkv error with a message; the conversation is unchanged and still answers."""
    session = mmkv.Session(tiny, config=mmkv.SessionConfig.of(max_image_pixels=100_000))
    image, _, _ = _images(tiny)
    session.add_image(image)
    before = [dict(m, content=list(m["content"])) for m in session.messages]
    bad_inputs = [
        (b"not an image", mmkv.UnreadableImageError, "not a readable image"),
        (tmp_path / "missing.png", mmkv.UnreadableImageError, "no image file"),
        (Image.new("RGB", (0, 3)), mmkv.EmptyImageError, "no pixels"),
        (Image.new("RGB", (1000, 1000)), mmkv.ImageTooLargeError, "over the bound"),
        (3.5, mmkv.UnsupportedInputError, "got float"),
    ]
    for bad, error, message in bad_inputs:
        with pytest.raises(error, match=message):
            session.add_image(bad)
    assert session.messages == before and len(session.images) == 1
    assert session.ask("Still there?", max_new_tokens=1).images[0].index == 0


def test_wrong_store_type_raises_store_mismatch(tiny):
    """Passing an EncoderStore as the KV store (or the reverse) raises StoreMismatchError."""
    with pytest.raises(mmkv.StoreMismatchError, match="KVStore"):
        mmkv.Session(tiny, store=EncoderStore())
    with pytest.raises(mmkv.StoreMismatchError, match="EncoderStore"):
        mmkv.Session(tiny, encoder_store=KVStore())


def test_a_stored_segment_of_another_shape_is_refused(tiny, monkeypatch):
    """A store that hands back KV of another model's shape raises StoreMismatchError, not a silent splice."""
    store, (image, _, _) = KVStore(), _images(tiny)
    warm = mmkv.Session(tiny, store=store)
    warm.add_image(image)
    warm.next_token_logits("?")
    segment, tier = store.lookup(warm.images[0].digest, tiny)
    wrong = replace(segment, keys=segment.keys[:1], values=segment.values[:1])
    monkeypatch.setattr(store, "lookup", lambda digest, handle: (wrong, tier))
    session = mmkv.Session(tiny, store=store)
    session.add_image(image)
    with pytest.raises(mmkv.StoreMismatchError, match="layers, kv heads"):
        session.next_token_logits("?")
    monkeypatch.undo()
    assert session.next_token_logits("?").shape == (len(tiny.tokenizer),)


def test_invalid_config_raises():
    """Unknown reuse policies, negative seams and empty windows raise ValueError."""
    for kwargs in ({"reuse": "all"}, {"seam": -1}, {"window": 0}):
        with pytest.raises(ValueError):
            mmkv.SessionConfig.of(**kwargs)


def test_fork_copies_the_conversation_not_the_cache(tiny):
    """fork(reuse="none") renders the same prompt, starts with an empty live cache, and gives the same logits
    as the original; later turns of one do not change the other."""
    session = mmkv.Session(tiny, reuse="encoder")
    image, _, _ = _images(tiny)
    session.add_image(image)
    logits = session.next_token_logits("What is it?")
    cold = session.fork(reuse="none")
    assert cold.config.reuse == "none" and cold.live.num_tokens == 0
    assert torch.equal(cold.render("What is it?")[0], session.render("What is it?")[0])
    assert _max_abs(cold.next_token_logits("What is it?"), logits) <= 1e-5
    cold.add_text("more")
    assert len(cold.messages[-1]["content"]) == len(session.messages[-1]["content"]) + 1


class _AddBias(torch.nn.Module):
    def __init__(self, bias: torch.Tensor) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.bias


def test_answers_never_contain_vision_tokens_even_when_the_model_favours_them():
    """With the image-pad logit forced highest, ask still answers (in text) instead of feeding a pad back."""
    handle = mmkv.load("tiny-qwen3-vl", device="cpu")
    proc = handle.processor
    boost = torch.zeros(handle.model.lm_head.out_features)
    boost[proc.image_token_id] = 100.0  # the pad's logit beats every other
    handle.model.lm_head = torch.nn.Sequential(handle.model.lm_head, _AddBias(boost))
    session = mmkv.Session(handle)
    session.add_image(_images(handle)[0])
    logits = session.next_token_logits("What is it?")
    answer = session.ask("What is it?", max_new_tokens=4)
    vision = {proc.image_token_id, proc.vision_start_token_id, proc.vision_end_token_id}
    assert answer.token_ids and not vision & set(answer.token_ids)
    assert int(logits.argmax()) == proc.image_token_id  # the model's own logits do favour the pad


def test_an_image_replaced_by_another_of_the_same_size_is_never_kept_as_live(tiny):
    """Two different images of one grid at the same place in consecutive prompts (window=1, same text around
    them): their pads have the same ids and positions, but the second is never served the first's live KV
    (under kv it is computed; under the exact encoder policy the logits equal full recompute)."""
    patch = tiny.processor.patch_size
    first, second = random_image(70, (4, 6), patch), random_image(71, (4, 6), patch)
    for reuse in ("kv", "encoder"):
        session = mmkv.Session(tiny, reuse=reuse, window=1)
        session.add_image(first)
        session.next_token_logits("What is it?")
        session.add_image(second)  # the window now shows only the second, where the first was
        logits = session.next_token_logits("What is it?")
        assert [r.source for r in session.last_prefill.images] == ["computed"]
        if reuse == "encoder":
            assert _max_abs(logits, session.fork(reuse="none").next_token_logits("What is it?")) <= 1e-4


def test_stream_yields_the_text_ask_gives_and_an_early_close_changes_nothing(tiny):
    """stream's pieces join to the same answer ask gives on a copy of the conversation, last_answer holds it,
    and an iterator closed after its first piece leaves the conversation as it was."""
    image = random_image(80, (4, 6), tiny.processor.patch_size)
    session = mmkv.Session(tiny)
    session.add_image(image)
    expected = session.fork().ask("Describe it.", max_new_tokens=8)
    pieces = list(session.stream("Describe it.", max_new_tokens=8))
    assert "".join(pieces) == expected.text == session.last_answer.text
    assert session.last_answer.token_ids == expected.token_ids
    assert session.messages[-1] == {"role": "assistant", "content": [{"type": "text", "text": expected.text,
                                                                       "item_id": 1}]}  # fmt: skip
    before = session.messages
    stream = session.stream("And now?", max_new_tokens=8)
    next(stream, None)
    stream.close()
    assert session.messages == before
    with pytest.raises(ValueError, match="max_new_tokens"):
        session.stream("q", max_new_tokens=0)  # checked at the call, not at the first piece


def test_images_in_the_system_message_equal_the_models_own_forward(tiny):
    """add_image(role="system"): the image renders inside the system message, logits as the model's own."""
    image = random_image(81, (4, 6), tiny.processor.patch_size)
    session = mmkv.Session(tiny, reuse="none")
    session.add_text("Reference screen:", role="system")
    session.add_image(image, role="system")
    assert [m["role"] for m in session.messages] == ["system"]
    logits = session.next_token_logits("Is this the reference?")
    assert _max_abs(logits, full_forward_logits(tiny, session, "Is this the reference?")) <= 1e-4
