"""examples/client.py (the README's client example) against a real server on the shipped model."""

from __future__ import annotations

import pytest

import mmkv
from app.trajectory import NEXT_ACTION, POLICY
from examples.client import main
from tests.serve.conftest import InProcessServer

pytestmark = pytest.mark.shipped


def test_the_readme_client_example_answers_like_a_session_and_reports_its_reuse(tmp_path):
    server = InProcessServer(["--model", "small-qwen3-vl", "--device", "cpu"], tmp_path / "server.log")
    with server:
        turns = main(["--base-url", f"{server.base_url}/v1"])
    assert turns[0]["answer"] == "click(approve)"  # the demo's first step, as the shipped model answers it
    assert [i["source"] for i in turns[0]["images"]] == ["computed"]
    assert [i["source"] for i in turns[1]["images"]] == ["live", "memory"]  # spliced, re-rotated
    assert turns[1]["cached"] >= turns[0]["prompt"] and turns[1]["prefilled_tokens"] < turns[1]["prompt"]
    session = mmkv.Session(mmkv.load("small-qwen3-vl", device="cpu"))
    session.add_text(POLICY, "system")
    for turn, screen in zip(turns, ("panel_red.png", "panel_red.png"), strict=True):
        session.add_image(f"app/examples/{screen}")
        assert session.ask(NEXT_ACTION, max_new_tokens=12).text == turn["answer"]  # joins the answer too
