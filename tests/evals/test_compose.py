"""The compose eval end to end on a few samples (both tiny families): exact where the segment did not move, the
splice really spliced, every repair recomputed its budget, every arm, shift and preamble style reported."""

from __future__ import annotations

import json
import math

import pytest

from evals.compose import aggregate as compose_aggregate
from evals.compose import arm_names, build_parser, compose_samples, run
from evals.preambles import STYLES, calibration_texts, make_preamble

REPAIRS = [("seam", 0.05), ("deviation", 0.05), ("attention", 0.05)]  # the default repair arms


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen2.5-vl"])
def results(request, tmp_path_factory, tiny_by_name):
    out = tmp_path_factory.mktemp("compose")
    args = build_parser().parse_args(
        [
            "--model",
            request.param,
            "--n",
            "3",
            "--shifts",
            "0",
            "40",
            "--seams",
            "0",
            "3",
            "--texts",
            "notes",
            "log",
            "--out",
            str(out),
        ]
    )
    return run(**{**vars(args), "model": tiny_by_name[request.param]}, progress=False), out


def test_every_arm_gate_shift_and_style_is_written(results):
    """Cells per gate, per requested shift (signed by direction) and per preamble style, for every arm; each
    style of preamble is its own text, reaching the requested length."""
    res, out = results
    on_disk = json.loads((out / "results.json").read_text())
    names = arm_names([0, 3], REPAIRS)
    assert names[-3] == "patch r=4 s=1" and res["settings"]["patch_fit_seconds"] > 0
    assert list(on_disk["aggregate"]) == names and list(on_disk["by_shift"]) == names
    assert names[-6:-3] == ["seam 5% s=1", "dev 5% s=1", "att 5% s=1"]
    shifts = {r["shift"] for r in res["records"]}
    moved = shifts - {0}  # both directions: spliced after the preamble (+), compiled after it (-)
    assert 0 in shifts and len(moved) == 2 and sum(moved) == 0 and min(map(abs, moved)) >= 40
    assert {r["target"] for r in res["records"]} == {0, 40, -40}  # samples: (0, notes), (40, notes), (0, log)
    for arm in names:
        assert set(on_disk["aggregate"][arm]) == {"text", "screen", "all"}
        if (
            arm == "patch r=4 s=1"
        ):  # only where a preamble moved the segment after it: 2 samples, use direction
            assert on_disk["aggregate"][arm]["all"]["n"] == 2 and set(on_disk["by_shift"][arm]) == {
                "40",
                "all",
            }
            continue
        assert on_disk["aggregate"][arm]["all"]["n"] == 12  # 6 samples x 2 directions
        assert set(on_disk["by_shift"][arm]) == {"0", "40", "-40", "all"}
        assert set(on_disk["by_style"][arm]) == {"notes", "log", "all"}
    table = (out / "results.md").read_text()
    for arm in names:  # a cell no better than a blind guesser of its answers says so in its label
        label = "all (at chance)" if on_disk["aggregate"][arm]["all"]["at_chance"] else "all"
        assert f"| {arm} | {label} | {2 if arm.startswith('patch') else 12} |" in table
    assert "## By shift" in table
    assert "## By preamble style" in table and "segment recomputed" in table
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_segment_that_did_not_move_is_exact_and_one_that_moved_is_not(results):
    """Shift 0: the segment sits where it was compiled, so every splice (rotated or not, any seam) and the
    suffix edit reproduce full recompute. Shifted: re-rotation changes the keys, so it differs from no-rotate."""
    res, _ = results
    for r in res["records"]:
        if r["shift"] == 0 and r["kind"] in ("splice", "no-rotate", "repair", "suffix"):
            assert r["agree"] and r["cosine"] > 0.99999, r
    for r in res["records"]:
        if r["shift"] != 0 and r["kind"] == "splice":
            control = next(
                c for c in res["records"]
                if c["sample"] == r["sample"] and c["kind"] == "no-rotate" and c["seam"] == r["seam"]
                and c["shift"] == r["shift"]
            )  # fmt: skip
            assert r["cosine"] != control["cosine"]


def test_the_splice_computes_only_the_seam_of_the_segment_and_a_repair_its_budget(results):
    """fraction x prompt = tokens run through the model: everything but the segment, plus its seam (and, under
    a repair, ceil(budget x the rest)); the segment's recomputed tokens are counted alike."""
    res, _ = results
    assert min(res["settings"]["segment_tokens"].values()) > 20
    for r in res["records"]:
        computed, length = round(r["fraction"] * r["prompt_tokens"]), r["segment_tokens"]
        if r["kind"] == "full":
            assert computed == r["prompt_tokens"]
        elif r["kind"] in ("splice", "no-rotate", "repair", "patch"):
            own = r["seam"] + (math.ceil(r["budget"] * (length - r["seam"])) if r["kind"] == "repair" else 0)
            assert computed == r["prompt_tokens"] - length + own and r["segment_recomputed"] == own, r
            assert (r["pass_tokens"] > 0) == (r["repair"] in ("deviation", "attention")), r
        else:  # the edit turn: the edit's recomputation and the question, a part of the prompt
            assert 0 < computed < r["prompt_tokens"]


def test_preambles_are_seeded_varied_and_long_enough(tiny_by_name):
    """Each style: "" for 0 tokens; seeded (same seed, same text), varied (another seed or style, another text),
    at least the tokens asked for, ending with a blank line; an unknown style is refused."""
    tokenizer = tiny_by_name["tiny-qwen3-vl"].processor.tokenizer
    assert make_preamble(tokenizer, 0, 1) == ""
    for tokens in (60, 200):
        texts = {style: make_preamble(tokenizer, tokens, 1, style) for style in STYLES}
        assert len(set(texts.values())) == len(STYLES)
        for style, a in texts.items():
            b = make_preamble(tokenizer, tokens, 2, style)
            assert a == make_preamble(tokenizer, tokens, 1, style) and a != b and a.endswith("\n\n")
            assert len(tokenizer(a)["input_ids"]) >= tokens
    with pytest.raises(ValueError, match="style"):
        make_preamble(tokenizer, 10, 1, "poetry")


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
    with pytest.raises(ValueError, match="budget"):
        run("tiny-qwen3-vl", n=1, budgets=(2.0,))
    with pytest.raises(ValueError, match="texts"):
        run("tiny-qwen3-vl", n=1, texts=("poetry",))


def test_patches_are_fitted_on_other_styles_than_they_are_tested_on(tiny_by_name):
    """The calibration texts for a style are of the two other styles (two lengths each) and none is a text the eval
    itself shows (other seeds)."""
    tokenizer = tiny_by_name["tiny-qwen3-vl"].processor.tokenizer
    heads = {"notes": "Notes from", "archive": "Archive notes.", "log": "Tool log."}
    for style in STYLES:
        texts = calibration_texts(tokenizer, style, lengths=(40, 80))
        assert len(texts) == 4 and not any(t.startswith(heads[style]) for t in texts)
        assert {h for t in texts for s, h in heads.items() if t.startswith(h)} == {
            h for s, h in heads.items() if s != style
        }
        shown = {
            make_preamble(tokenizer, n, seed + n + 7919 * STYLES.index(s), s)
            for s in STYLES
            for n in (40, 80)
            for seed in range(8)
        }
        assert not shown & set(texts)
