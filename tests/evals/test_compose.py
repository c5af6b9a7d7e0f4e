"""The compose eval end to end on a few samples (both tiny families): exact where the segment did not move, the
splice really spliced, every arm and shift reported."""

from __future__ import annotations

import json

import pytest

from evals.compose import aggregate as compose_aggregate
from evals.compose import arm_names, build_parser, compose_samples, make_preamble, run


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen2.5-vl"])
def results(request, tmp_path_factory, tiny_by_name):
    out = tmp_path_factory.mktemp("compose")
    args = build_parser().parse_args(
        ["--model", request.param, "--n", "2", "--shifts", "0", "40", "--seams", "0", "3", "--out", str(out)]
    )
    return run(**{**vars(args), "model": tiny_by_name[request.param]}, progress=False), out


def test_every_arm_gate_and_shift_is_written(results):
    res, out = results
    on_disk = json.loads((out / "results.json").read_text())
    names = arm_names([0, 3])
    assert list(on_disk["aggregate"]) == names and list(on_disk["by_shift"]) == names
    shifts = {r["shift"] for r in res["records"]}
    moved = shifts - {0}  # both directions: spliced after the preamble (+), compiled after it (-)
    assert 0 in shifts and len(moved) == 2 and sum(moved) == 0 and min(map(abs, moved)) >= 40
    for arm in names:
        assert set(on_disk["aggregate"][arm]) == {"text", "screen", "all"}
        assert on_disk["aggregate"][arm]["all"]["n"] == 8  # 4 samples x 2 directions
        assert set(on_disk["by_shift"][arm]) == {*map(str, shifts), "all"}
    table = (out / "results.md").read_text()
    assert all(f"| {arm} | all | 8 |" in table for arm in names) and "## By shift" in table
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_segment_that_did_not_move_is_exact_and_one_that_moved_is_not(results):
    """Shift 0: the segment sits where it was compiled, so every splice (rotated or not, any seam) and the
    suffix edit reproduce full recompute. Shifted: re-rotation changes the keys, so it differs from no-rotate."""
    res, _ = results
    for r in res["records"]:
        if r["shift"] == 0 and r["kind"] in ("splice", "no-rotate", "suffix"):
            assert r["agree"] and r["cosine"] > 0.99999, r
    for r in res["records"]:
        if r["shift"] != 0 and r["kind"] == "splice":
            control = next(
                c for c in res["records"]
                if c["sample"] == r["sample"] and c["kind"] == "no-rotate" and c["seam"] == r["seam"]
                and c["shift"] == r["shift"]
            )  # fmt: skip
            assert r["cosine"] != control["cosine"]


def test_the_splice_computes_only_the_seam_of_the_segment(results):
    """fraction x prompt = tokens run through the model: everything but the segment, plus its seam."""
    res, _ = results
    assert min(res["settings"]["segment_tokens"].values()) > 20
    for r in res["records"]:
        computed, length = round(r["fraction"] * r["prompt_tokens"]), r["segment_tokens"]
        if r["kind"] == "full":
            assert computed == r["prompt_tokens"]
        elif r["kind"] in ("splice", "no-rotate"):
            assert computed == r["prompt_tokens"] - length + r["seam"], r
        else:  # the edit turn: the edit's recomputation and the question, a part of the prompt
            assert 0 < computed < r["prompt_tokens"]


def test_preambles_are_seeded_varied_and_long_enough(tiny_by_name):
    tokenizer = tiny_by_name["tiny-qwen3-vl"].processor.tokenizer
    assert make_preamble(tokenizer, 0, 1) == ""
    for tokens in (60, 200):
        a, b = make_preamble(tokenizer, tokens, 1), make_preamble(tokenizer, tokens, 2)
        assert a == make_preamble(tokenizer, tokens, 1) and a != b and a.endswith("\n\n")
        assert len(tokenizer(a)["input_ids"]) >= tokens


def test_samples_are_held_out_without_their_own_erratum():
    for gate in ("text", "screen"):
        samples = compose_samples(gate, 6)
        assert len({s.digest for s, _ in samples}) == 6
        assert all(len(s.turns) == 1 and f"account_role: {role}." in s.system for s, role in samples)


def test_aggregate_is_pure_and_counts_what_it_reads():
    rows = [
        {"arm": "full", "shift": 0, "agree": 1, "correct": 1, "cosine": 1.0, "fraction": 1.0, "ttft_s": 0.2,
         "full_ttft_s": 0.2},
        {"arm": "splice s=0", "shift": 0, "agree": 1, "correct": 0, "cosine": 0.9, "fraction": 0.5, "ttft_s": 0.1,
         "full_ttft_s": 0.2},
        {"arm": "splice s=0", "shift": 64, "agree": 0, "correct": 0, "cosine": 0.7, "fraction": 0.5, "ttft_s": 0.1,
         "full_ttft_s": 0.3},
    ]  # fmt: skip
    table = compose_aggregate(rows, "shift")
    assert list(table) == ["full", "splice s=0"] and table["splice s=0"]["all"]["n"] == 2
    cell = table["splice s=0"]["all"]
    assert cell["agreement"]["value"] == 0.5 and cell["cosine"]["value"] == pytest.approx(0.8)
    assert cell["speedup"]["value"] == pytest.approx(2.5) and table["splice s=0"][64]["n"] == 1
    with pytest.raises(ValueError, match="shifts and seams"):
        run("tiny-qwen3-vl", n=1, shifts=())
    with pytest.raises(ValueError, match="directions"):
        run("tiny-qwen3-vl", n=1, directions=("sideways",))
