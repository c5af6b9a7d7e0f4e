"""Request: refused on construction when it cannot be run, cancellable from any thread, its deadline and its
KV need read off what it holds."""

from __future__ import annotations

import threading
import time

import pytest

from mmkv.engine import Request
from mmkv.engine.request import Status
from mmkv.runtime import DecodeOptions, TurnPolicy
from tests.helpers import IMAGES, synthetic_layout

LAYOUT = synthetic_layout([("text", 5), ("image", 4, 0), ("text", 3)])  # 14 tokens


def _request(**changes) -> Request:
    fields = {"layout": LAYOUT, "images": IMAGES, "policy": TurnPolicy(), "options": DecodeOptions(6),
              "emit": lambda event: None} | changes  # fmt: skip
    return Request(**fields)


@pytest.mark.parametrize(
    "changes, error, message",
    [({"layout": "14 tokens"}, TypeError, "layout must be a PromptLayout, got str"),
     ({"layout": synthetic_layout([])}, ValueError, "the prompt is empty"),
     ({"options": {"max_new_tokens": 6}}, TypeError, "options must be DecodeOptions, got dict"),
     ({"emit": None}, TypeError, "emit must be callable")],
)  # fmt: skip
def test_a_request_that_cannot_run_is_refused_when_made(changes, error, message):
    with pytest.raises(error, match=message):
        _request(**changes)


def test_a_new_request_waits_and_needs_its_prompt_and_whole_budget():
    request = _request()
    assert request.status is Status.WAITING and not request.is_finished and not request.should_stop()
    assert request.kv_tokens() == 14 + 6


def test_cancel_from_another_thread_stops_it_and_only_it():
    request, other = _request(), _request()
    thread = threading.Thread(target=request.cancel)
    thread.start()
    thread.join()
    assert request.is_cancelled and request.should_stop() and not other.should_stop()


def test_the_deadline_stops_it_once_passed_and_never_without_one():
    assert _request(deadline=time.monotonic() - 1).should_stop()
    assert _request(deadline=time.monotonic() - 1).is_expired
    assert not _request(deadline=time.monotonic() + 3600).should_stop()
    assert not _request(deadline=None).is_expired
