"""The VQA eval: end to end on a few samples (every arm against none), aggregation and its intervals, a JSONL run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from evals.report import bootstrap
from evals.tasks import make_samples
from evals.vqa import (
    ARM_NAMES,
    MIN_SHIFT,
    REPAIR_ARMS,
    aggregate,
    build_parser,
    run,
    score_sample,
)

CATEGORIES = ["perception", "agentic"]  # no image repeats within a sample: kv at the same positions is exact


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_by_name) -> tuple[dict, object]:
    """One run over 2 samples of 2 categories with every arm, through the command line's own parser."""
    out = tmp_path_factory.mktemp("vqa")
    args = build_parser().parse_args(
        ["--model", "tiny-qwen3-vl", "--n", "2", "--categories", *CATEGORIES, "--out", str(out)]
    )
    settings = {**vars(args), "model": tiny_by_name["tiny-qwen3-vl"]}
    return run(**settings, progress=False), out


def _records(results: dict, arm: str) -> list[dict]:
    return [r for r in results["records"] if r["arm"] == arm]


def test_every_arm_and_category_is_reported(results):
    """The JSON holds 4 records per arm and a cell for every arm x category (and "all"); the files are written."""
    res, out = results
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["aggregate"] == json.loads(json.dumps(res["aggregate"]))
    assert list(on_disk["aggregate"]) == list(ARM_NAMES)
    for arm in ARM_NAMES:
        assert set(on_disk["aggregate"][arm]) == {*CATEGORIES, "all"}
        assert on_disk["aggregate"][arm]["all"]["n"] == 4 and len(_records(res, arm)) == 4
    table = (out / "results.md").read_text()
    for arm in ARM_NAMES:  # a cell no better than a blind guesser of its answers says so in its label
        label = "all (at chance)" if on_disk["aggregate"][arm]["all"]["at_chance"] else "all"
        assert f"| {arm} | {label} | 4 |" in table


def test_none_is_its_own_reference(results):
    """none agrees with itself and has logit cosine 1 with itself; its speedup is 1."""
    res, _ = results
    cell = res["aggregate"]["none"]["all"]
    assert cell["agreement"]["value"] == 1.0 and cell["speedup"]["value"] == pytest.approx(1.0)
    assert all(r["cosine"] == pytest.approx(1.0, abs=1e-12) for r in _records(res, "none"))


def test_encoder_reuse_is_exact(results):
    """Cached vision outputs give none's answers (agreement 1.0) and logits (cosine > 0.9999), from the store."""
    res, _ = results
    records = _records(res, "encoder")
    assert res["aggregate"]["encoder"]["all"]["agreement"]["value"] == 1.0
    assert all(r["cosine"] > 0.9999 and r["top1_agree"] for r in records)
    assert all(set(r["sources"]) == {"memory"} for r in records)


def test_kv_at_the_same_positions_matches_none(results):
    """KV cached by a pass over the same sample lands at shift 0 and gives logit cosine > 0.999."""
    res, _ = results
    for record in _records(res, "kv"):
        assert record["shifts"] and set(record["shifts"]) == {0}
        assert record["cosine"] > 0.999 and set(record["sources"]) == {"memory"}
        assert record["prefilled_tokens"] < record["prompt_tokens"]


def test_the_reused_fraction_is_the_spliced_share_of_the_prompt(results):
    """Per category, ``reused`` is sum(reused) / sum(prompt tokens) of the cell: 0 under none and encoder (the
    image is prefilled), a large share under kv (64-token pictures spliced, seam 1 recomputed)."""
    res, _ = results
    for category in CATEGORIES:
        for arm in ("none", "encoder", "kv"):
            rows = [r for r in _records(res, arm) if r["category"] == category]
            expected = sum(r["reused_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)
            assert res["aggregate"][arm][category]["reused_fraction"]["value"] == pytest.approx(expected)
        assert res["aggregate"]["none"][category]["reused_fraction"]["value"] == 0.0
        assert res["aggregate"]["encoder"][category]["reused_fraction"]["value"] == 0.0
        assert (
            res["aggregate"]["kv"][category]["reused_fraction"]["value"] > 0.2
        )  # tiny tokenizer: long texts
    assert "| reused |" in (results[1] / "results.md").read_text()


def test_shifted_arms_move_every_image_at_least_100_positions(results):
    """Every shifted arm splices store hits cached >= 100 positions away, recorded per sample."""
    res, _ = results
    for arm in ("kv-shifted", "kv-no-seam", "kv-temporal-only", "kv-no-rotate"):
        for record in _records(res, arm):
            assert record["shifts"] and all(abs(s) >= MIN_SHIFT for s in record["shifts"])
            assert record["min_abs_shift"] >= MIN_SHIFT and set(record["sources"]) == {"memory"}
        assert res["aggregate"][arm]["all"]["min_abs_shift"] >= MIN_SHIFT
    seamless = {r["digest"]: r["prefilled_tokens"] for r in _records(res, "kv-no-seam")}
    for record in _records(res, "kv-shifted"):  # seam 1 recomputes one more token per image
        assert record["prefilled_tokens"] == seamless[record["digest"]] + len(record["shifts"])


def test_repair_arms_recompute_their_budget_of_each_image(results):
    """Per sample: the 5% arms (leading, deviation, attention) compute the same tokens, ceil(0.05 x (n - 1)) per
    image of n tokens more than kv-shifted; seam 16 computes 16 per image; ``img recomputed`` is the share of the
    spliced images' tokens computed; only the ranked arms spend time choosing (a pass of their own)."""
    res, out = results
    base = {r["digest"]: r for r in _records(res, "kv-shifted")}
    for arm, (seam, repair, budget) in REPAIR_ARMS.items():
        for record in _records(res, arm):
            plain = base[record["digest"]]
            tokens = record["image_tokens"]
            assert tokens == plain["image_tokens"] > 0 and set(record["sources"]) == {"memory"}
            num_images, per_image = len(record["shifts"]), tokens // len(record["shifts"])
            extra = num_images * (
                seam - 1 if seam is not None else math.ceil((budget or 0) * (per_image - 1) - 1e-9)
            )
            assert record["prefilled_tokens"] == plain["prefilled_tokens"] + extra, arm
            assert record["image_recomputed"] == plain["image_recomputed"] + extra == num_images + extra
            assert (record["pass_tokens"] > 0) == (repair != "seam") and record["repair_s"] >= 0
        cell = res["aggregate"][arm]["all"]["image_recomputed"]
        rows = _records(res, arm)
        assert cell["value"] == pytest.approx(
            sum(r["image_recomputed"] for r in rows) / sum(r["image_tokens"] for r in rows)
        )
    assert res["aggregate"]["none"]["all"]["image_recomputed"]["value"] == 0.0  # nothing spliced: 0, not NaN
    assert "| img recomputed | repair ms |" in (out / "results.md").read_text()


def test_the_plot_is_a_png(results):
    """results.png decodes as a PNG image of a sensible size."""
    _, out = results
    with Image.open(out / "results.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 400 and image.size[1] > 200


def test_shift_holds_for_long_trajectories(tiny_by_name):
    """A trajectory of 6 screens (some repeated): every spliced screen still moves >= 100 positions."""
    handle = tiny_by_name["tiny-qwen2.5-vl"]
    sample = max(make_samples("trajectory", 10), key=lambda s: s.num_images)
    assert sample.num_images == 6
    records = score_sample(handle, sample, arms=["kv-shifted"], max_new_tokens=2)
    assert set(records) == {"none", "kv-shifted"}
    shifts = records["kv-shifted"]["shifts"]
    assert len(shifts) == 6 and min(abs(s) for s in shifts) >= MIN_SHIFT


def test_a_model_that_favours_an_image_pad_still_answers_in_text(tiny_by_name):
    """A sample whose kv-no-seam answer once favoured an image pad under tiny-qwen3-vl is scored; no answer
    contains a vision token (the session never generates them)."""
    handle = tiny_by_name["tiny-qwen3-vl"]
    sample = make_samples("reasoning", 5)[4]
    records = score_sample(handle, sample, arms=["kv-no-seam"])
    assert set(records) == {"none", "kv-no-seam"}
    proc = handle.processor
    vision = {proc.image_token_id, proc.vision_start_token_id, proc.vision_end_token_id}
    for record in records.values():
        assert not vision & set(handle.tokenizer(record["answer"], add_special_tokens=False)["input_ids"])


def _synthetic(
    arm: str, category: str, n: int, num_correct: int, none_ttft: float, ttft: float
) -> list[dict]:
    """Hand-made records: ``num_correct`` of ``n`` right (and agreeing), cosine 0.9, fixed TTFTs."""
    return [
        {
            "arm": arm,
            "category": category,
            "correct": i < num_correct,
            "agree": i < num_correct,
            "cosine": 0.9,
            "ttft_s": ttft * (1 + 0.01 * (i % 3)),
            "none_ttft_s": none_ttft * (1 + 0.01 * (i % 3)),
            "min_abs_shift": 120 + i if arm == "kv" else None,
            "max_abs_shift": 150 if arm == "kv" else None,
            "prompt_tokens": 100,
            "reused_tokens": 75 if arm == "kv" else 0,
        }
        for i in range(n)
    ]


def test_aggregate_of_known_records():
    """Known accuracy, agreement, cosine and speedup come back per arm and category, each inside its interval."""
    records = (
        _synthetic("none", "a", 40, 30, 0.2, 0.2)
        + _synthetic("kv", "a", 40, 10, 0.2, 0.05)
        + _synthetic("kv", "b", 20, 20, 0.2, 0.1)
    )
    table = aggregate(records)
    assert list(table) == ["none", "kv"] and list(table["kv"]) == ["a", "b", "all"]
    a, b, both = table["kv"]["a"], table["kv"]["b"], table["kv"]["all"]
    assert (a["n"], b["n"], both["n"]) == (40, 20, 60)
    assert table["none"]["a"]["accuracy"]["value"] == 0.75 and a["accuracy"]["value"] == 0.25
    assert both["accuracy"]["value"] == pytest.approx(0.5) and b["agreement"]["value"] == 1.0
    assert a["cosine"]["value"] == pytest.approx(0.9) and a["speedup"]["value"] == pytest.approx(4.0)
    assert b["speedup"]["value"] == pytest.approx(2.0) and table["none"]["a"]["min_abs_shift"] is None
    assert (a["min_abs_shift"], both["min_abs_shift"], both["max_abs_shift"]) == (120, 120, 150)
    assert b["reused_fraction"]["value"] == 0.75 and table["none"]["all"]["reused_fraction"]["value"] == 0.0
    for cells in table.values():
        for cell in cells.values():
            for key in ("accuracy", "agreement", "cosine", "ttft_s", "speedup", "reused_fraction"):
                assert cell[key]["low"] <= cell[key]["value"] <= cell[key]["high"], (key, cell[key])
    assert (
        b["agreement"]["low"] == pytest.approx(0.8389, abs=1e-4) and b["agreement"]["high"] == 1.0
    )  # Wilson 20/20
    assert aggregate(records) == table  # seeded


def test_bootstrap_interval_narrows_with_more_samples():
    """The same proportion over 10x the samples gives a narrower interval; both contain the estimate."""
    small = bootstrap([np.array([1.0] * 30 + [0.0] * 10)], lambda x: x.mean(-1))
    large = bootstrap([np.array([1.0] * 300 + [0.0] * 100)], lambda x: x.mean(-1))
    assert small.value == large.value == 0.75
    assert small.low <= 0.75 <= small.high and large.low <= 0.75 <= large.high
    assert large.high - large.low < 0.5 * (small.high - small.low)
    with pytest.raises(ValueError, match="equal-length"):
        bootstrap([np.array([])], lambda x: x.mean(-1))


def test_unknown_arm_is_refused(tiny_by_name):
    """An arm name outside ARM_NAMES is a caller mistake that names the choices."""
    sample = make_samples("perception", 1)[0]
    with pytest.raises(ValueError, match="kv-shifted"):
        score_sample(tiny_by_name["tiny-qwen3-vl"], sample, arms=["kv-sideways"])


def test_a_jsonl_of_two_tasks_runs(tmp_path, tiny_by_name):
    """A user's 2-line JSONL runs on its own as category "custom" and writes all three files."""
    lines = []
    for i, sample in enumerate(make_samples("perception", 2)):
        sample.turns[0].images[0].save(tmp_path / f"{i}.png")
        lines.append(
            json.dumps({"images": [f"{i}.png"], "question": sample.question, "answer": sample.answer})
        )
    (tmp_path / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    args = build_parser().parse_args(
        [
            "--jsonl",
            str(tmp_path / "tasks.jsonl"),
            "--arms",
            "kv-shifted",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
        ]
    )
    res = run(**{**vars(args), "model": tiny_by_name["tiny-qwen2.5-vl"]}, progress=False)
    assert {r["category"] for r in res["records"]} == {"custom"} and len(res["records"]) == 4
    assert (
        set(res["aggregate"]) == {"none", "kv-shifted"} and res["aggregate"]["kv-shifted"]["custom"]["n"] == 2
    )
    assert all((out / name).stat().st_size > 0 for name in ("results.json", "results.md", "results.png"))
