"""AnswerText: the streamed deltas joined are the whole decode, stop strings cut at their first appearance
whatever the token split, and the work per token stays flat (counted, not timed)."""

from __future__ import annotations

import numpy as np
import pytest

from mmkv.runtime import AnswerText
from mmkv.runtime.answer_text import token_bytes
from tests.conftest import random_text_ids


def test_the_streamed_text_joined_is_the_whole_decode_for_random_tokens(tiny):
    """For random token sequences (multi-byte characters split over tokens included), the deltas joined equal
    the answer text, which equals decoding all tokens at once, stripped: the incremental window loses nothing."""
    rng = np.random.default_rng(0)
    tokenizer = tiny.tokenizer
    multibyte = [
        i
        for i in range(len(tokenizer))
        if len(token_bytes(tokenizer, i)) and token_bytes(tokenizer, i)[0] >= 0x80
    ]
    for trial in range(30):
        ids = random_text_ids(tiny, rng, int(rng.integers(1, 60))).tolist()
        if multibyte and trial % 2:
            ids += [int(x) for x in rng.choice(multibyte, size=6)]
            rng.shuffle(ids)
        text = AnswerText(tokenizer)
        deltas = "".join(text.add(t) for t in ids) + text.finish()
        expected = tokenizer.decode(ids, skip_special_tokens=True).strip()
        assert deltas == text.text == expected, (ids, deltas, expected)


@pytest.mark.parametrize("stop", ["b", "ab", "\n\n", "xyz"])
def test_stop_strings_cut_the_answer_at_their_first_appearance_whatever_the_token_split(tiny, stop):
    """The answer ends before the first stop string, found when it spans token boundaries too; nothing after it
    is emitted, and what was emitted before is a prefix of the final text."""
    tokenizer = tiny.tokenizer
    for body in ("xxab\n\nab yy", "  ab", "b", "no stop here", "aab\n\n\n"):
        ids = tokenizer.encode(body, add_special_tokens=False)
        text = AnswerText(tokenizer, (stop,))
        emitted = ""
        for token in ids:
            emitted += text.add(token)
            if text.stopped:
                break
        emitted += text.finish()
        lead = body.lstrip()
        expected = (lead[: lead.find(stop)] if stop in lead else lead).strip()
        assert text.text == emitted == expected, (body, stop)


def test_decoding_is_linear_in_the_answer(tiny):
    """A 2000-token answer: the tokens handed to the tokenizer per step late in the answer are within 1.5x of
    those early in it (counted, not timed; the old decode re-decoded the whole answer every step)."""
    rng = np.random.default_rng(1)
    ids = random_text_ids(tiny, rng, 2000).tolist()
    text = AnswerText(tiny.tokenizer)
    per_step = []
    for token in ids:
        before = text.decoded_tokens
        text.add(token)
        per_step.append(text.decoded_tokens - before)
    early, late = sum(per_step[100:300]), sum(per_step[1700:1900])
    assert late <= 1.5 * early, (early, late)
    assert text.decoded_tokens <= 6 * len(ids)


def test_token_bytes_are_the_bytes_the_tokenizer_decodes_to(tiny):
    """For every token of the tiny vocabulary whose bytes form valid UTF-8 alone, they decode to the
    tokenizer's own text for it; a multi-byte character split over two tokens joins to its UTF-8 bytes."""
    tokenizer = tiny.tokenizer
    special = set(tokenizer.all_special_ids)
    for token in range(len(tokenizer)):
        if token in special:
            continue
        raw = token_bytes(tokenizer, token)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert text == tokenizer.decode([token]), token
    ids = tokenizer.encode("é中", add_special_tokens=False)
    assert b"".join(token_bytes(tokenizer, t) for t in ids) == "é中".encode()
