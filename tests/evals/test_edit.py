"""The edit eval: samples whose decision the edit flips, end to end on a few samples, exact arms exact."""

from __future__ import annotations

import json

import pytest

from evals.edit import ANSWER, ARM_NAMES, aggregate, build_parser, edit_samples, run
from evals.tasks import agentic_answer


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_by_name):
    out = tmp_path_factory.mktemp("edit")
    args = build_parser().parse_args(
        ["--model", "tiny-qwen2.5-vl", "--n", "2", "--k", "3", "--out", str(out)]
    )
    return run(**{**vars(args), "model": tiny_by_name["tiny-qwen2.5-vl"]}, progress=False), out


def test_samples_are_held_out_and_the_edit_flips_their_call():
    for gate in ("text", "screen"):
        samples = edit_samples(gate, 12)
        assert len(samples) == 12 and len({s.digest for s, _ in samples}) == 12
        for sample, role in samples:
            assert f"account_role: {role}." in sample.system and len(sample.turns) == 1
            assert sample.answer == ANSWER[role]
            other = "viewer" if role == "admin" else "admin"
            assert agentic_answer(other, "alert", True) == ANSWER[other] != sample.answer
        assert (sum(s.num_images for s, _ in samples) == 0) == (gate == "text")


def test_every_arm_and_gate_is_reported(results):
    res, out = results
    on_disk = json.loads((out / "results.json").read_text())
    assert list(on_disk["aggregate"]) == list(ARM_NAMES)
    for arm in ARM_NAMES:
        assert set(on_disk["aggregate"][arm]) == {"text", "screen", "all"}
        assert on_disk["aggregate"][arm]["all"]["n"] == 4
    table = (out / "results.md").read_text()
    assert all(f"| {arm} | all | 4 |" in table for arm in ARM_NAMES)
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exact_arms_agree_with_full_and_report_their_cost(results):
    res, _ = results
    by_arm = {arm: [r for r in res["records"] if r["arm"] == arm] for arm in ARM_NAMES}
    for record in by_arm["suffix"]:
        assert record["agree"] and record["cosine"] > 0.99999 and 0 < record["fraction"] < 1
    for record in by_arm["full"]:
        assert record["agree"] and record["fraction"] == 1.0
    for record in by_arm["ignored"]:
        assert record["fraction"] == 0.0 and record["edit_s"] == 0.0
    for record in by_arm["selective"]:
        in_place = next(r for r in by_arm["in_place"] if r["sample"] == record["sample"])
        assert record["recomputed"] == in_place["recomputed"] + 3  # k = 3 more tokens


def test_aggregate_counts_what_it_reads():
    records = [
        {
            "arm": "in_place",
            "gate": "text",
            "correct": c,
            "agree": c,
            "follows_old": not c,
            "cosine": 0.9,
            "fraction": 0.1,
            "edit_s": 0.002,
        }
        for c in (True, False, False, False)
    ]
    cell = aggregate(records)["in_place"]["text"]
    assert cell["n"] == 4 and cell["accuracy"]["value"] == 0.25 and cell["follows_old"]["value"] == 0.75
    assert cell["edit_ms"]["value"] == pytest.approx(2.0) and cell["fraction"]["value"] == pytest.approx(0.1)


def test_unknown_arms_and_gates_are_refused(tiny_by_name):
    with pytest.raises(ValueError, match="unknown arms \\['rewrite'\\]"):
        run(tiny_by_name["tiny-qwen3-vl"], n=1, arms=["rewrite"], progress=False)
    with pytest.raises(ValueError, match="unknown gates"):
        run(tiny_by_name["tiny-qwen3-vl"], n=1, gates=["audio"], progress=False)
