"""The repair beyond the seam as a request option: ``"mmkv": {"repair": ..., "budget": ...}`` against a real server
(``mmkv serve`` driven with the official openai client), counted in the reply's ``mmkv`` object, and refused by
name when out of range."""

from __future__ import annotations

import pytest

from tests.serve.conftest import image_part, run_server, user

pytestmark = pytest.mark.server

# an image of grid (4, 6) on tiny-qwen3-vl: 6 pads and two markers, 7 spliced after a seam of 1
SPLICED = 7
MOVED = [
    {
        "role": "system",
        "content": "Earlier steps: the settings page was opened, then closed, then opened again.",
    },
    user(image_part(7), "What is on the screen?"),
]


@pytest.fixture(scope="module")
def cold_server(tmp_path_factory):
    """A kv server without a pool of live caches: every request starts cold, so what it prefills is the plan."""
    with run_server(tmp_path_factory.mktemp("repair"), "--pool-bytes", "0") as running:
        yield running


def _ask(client, messages, mmkv=None):
    extra = {"extra_body": {"mmkv": mmkv}} if mmkv is not None else {}
    return client.chat.completions.create(
        model="tiny-qwen3-vl", messages=messages, max_tokens=4, temperature=0, **extra
    )


def test_a_request_chooses_its_repair_and_budget(cold_server):
    """The image is stored by one request and spliced, moved, by the next: each repair recomputes exactly
    ceil(budget x 7) more tokens than the plain seam (the default budget of a ranking is 5%); recomputing all
    of them gives the answer of full recompute."""
    client = cold_server.client()
    _ask(client, [user(image_part(7), "What is on the screen?")])  # computed and stored at another position
    seam = _ask(client, MOVED)
    base = seam.model_extra["mmkv"]
    assert [i["source"] for i in base["images"]] == ["memory"]
    for options, extra in [
        ({"repair": "deviation", "budget": 0.5}, 4),
        ({"repair": "attention", "budget": 0.5}, 4),
        ({"repair": "seam", "budget": 0.5}, 4),
        ({"repair": "attention"}, 1),
        ({"repair": "deviation", "budget": 0}, 0),
    ]:
        reply = _ask(client, MOVED, options)
        assert reply.model_extra["mmkv"]["prefilled_tokens"] == base["prefilled_tokens"] + extra, options
        assert reply.usage.prompt_tokens_details.cached_tokens == base["reused_tokens"] - extra
    whole = _ask(client, MOVED, {"repair": "deviation", "budget": 1.0})
    assert whole.model_extra["mmkv"]["prefilled_tokens"] == base["prefilled_tokens"] + SPLICED
    assert (
        whole.choices[0].message.content == _ask(client, MOVED, {"reuse": "none"}).choices[0].message.content
    )


@pytest.mark.parametrize(
    ("options", "words"),
    [({"budget": 1.5}, "mmkv.budget"), ({"budget": -1}, "mmkv.budget"), ({"budget": "lots"}, "mmkv.budget"),
     ({"repair": "magic"}, "mmkv.repair"), ({"repair": "seam", "depth": 2}, "Unrecognized request argument")],
)  # fmt: skip
def test_a_bad_repair_option_is_a_400_naming_it(cold_server, options, words):
    """Out of range, of the wrong type, unknown: 400 with the field's dotted name (an unknown key gets OpenAI's
    message), never a 500."""
    body = {"model": "tiny-qwen3-vl", "messages": MOVED, "max_tokens": 2, "mmkv": options}
    response = cold_server.post(body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
