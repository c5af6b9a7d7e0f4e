"""The VQA eval: every reuse arm against full recompute on the synthetic task suite (or a user's JSONL).

Per sample, each arm answers the sample's question in a fresh session; ``none`` (everything recomputed) is the
reference the others are scored against. Arms:

- ``none``: ``reuse="none"``, the reference;
- ``encoder``: cached vision-tower outputs (stores warmed by a pass over the same sample); exact;
- ``kv``: image KV cached by a pass over the same sample (same context, same positions), then spliced; exact,
  except that an image shown twice in a sample (a re-appearing ``trajectory`` screen) has one store entry, from
  its last occurrence, so its earlier occurrences are spliced from another position and context (the ``shift``
  column shows it);
- ``kv-shifted``: image KV cached in a *different* context (a long unrelated system message before the images)
  at positions at least ``MIN_SHIFT`` = 100 away, spliced at the sample's own positions, ``--seam`` tokens
  recomputed;
- ``kv-no-seam``: kv-shifted with seam 0; ``kv-temporal-only``: also only the temporal rotary channels
  re-rotated (ablation); ``kv-no-rotate``: seam 0 and no re-rotation at all (control);
- repairs beyond the seam (``TurnPolicy.repair``: kv-shifted, then a budget of each image's other tokens):
  ``kv-shifted-s16`` (seam 16), ``-seam-5%`` (the next 5%: a longer seam, as many tokens as the ranked arms),
  ``-dev-5%`` / ``-25%`` (those whose layer-1 KV deviates most in the new context), ``-att-5%`` / ``-25%`` (those
  the question attends to most); ``img recomputed``: images' tokens computed in context, ``repair ms``: choosing.

Each arm of each sample warms its own fresh stores, then runs one measured pass in a fresh session:
``next_token_logits(question)`` gives the first-token logits (cosine against ``none``) and the time to first token
(``last_prefill.seconds``: rendering to first-token logits on the host, store writes excluded, the span
``Answer.ttft_s`` covers); ``ask(question)`` on the same session then decodes the answer greedily (its prompt is
all live by then, so the answer continues exactly those logits). Warm passes are never timed. Scoring
(``score_sample``) is kept apart from aggregation (``aggregate``, ``evals/report.py``: per arm and category,
Wilson 95% intervals for accuracy and agreement, seeded bootstrap intervals for the rest, and the fraction of
prompt tokens reused: spliced rather than recomputed).

Example runs::

    python evals/vqa.py --model tiny-qwen3-vl --n 20
    python evals/vqa.py --model small-qwen3-vl
    python evals/vqa.py --model qwen3-vl-8b --device cuda --n 100 --categories agentic trajectory
    python evals/vqa.py --model tiny-qwen2.5-vl --n 5 --categories multihop --arms kv-shifted kv-shifted-dev-5%
    python evals/vqa.py --model qwen3-vl-8b --jsonl my_tasks.jsonl --out runs/mine

TTFTs are wall-clock: on a CPU shared with other jobs, ``OMP_NUM_THREADS=1`` keeps them sane for tiny models.
Writes ``results.json`` (per-sample records and the aggregate), ``results.md`` (the table, also printed) and
``results.png`` (agreement and speedup per arm) to ``--out`` (default ``runs/vqa-<model>``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mmkv  # noqa: E402
from evals.baselines import DELTA, attach_reference, mark_chance  # noqa: E402
from evals.report import VQA_METRICS, cells, default_out, script_main, vqa_markdown, vqa_plot, write_results  # noqa: E402
from evals.sample import Sample  # noqa: E402
from evals.tasks import CATEGORIES, load_jsonl, make_samples, normalise_answer, sample_session  # noqa: E402
from mmkv.cache import EncoderStore, KVStore  # noqa: E402
from mmkv.cli import HelpFormatter  # noqa: E402

__all__ = [
    "ARM_NAMES", "MIN_SHIFT", "REPAIR_ARMS", "Arm", "aggregate", "build_parser", "build_session", "image_starts",
    "make_arms", "run", "score_sample",
]  # fmt: skip

# kv-shifted arms: the least distance (positions) between where an image was cached and where it is placed
MIN_SHIFT = 100
REPAIR_ARMS = {  # kv-shifted with a repair beyond the seam: name -> (seam, None for --seam; repair; budget)
    "kv-shifted-s16": (16, "seam", None),
    "kv-shifted-seam-5%": (None, "seam", 0.05),
    "kv-shifted-dev-5%": (None, "deviation", 0.05),
    "kv-shifted-att-5%": (None, "attention", 0.05),
    "kv-shifted-dev-25%": (None, "deviation", 0.25),
    "kv-shifted-att-25%": (None, "attention", 0.25),
}
ARM_NAMES = ("none", "encoder", "kv", "kv-shifted", "kv-no-seam", "kv-temporal-only", "kv-no-rotate", *REPAIR_ARMS)  # fmt: skip
# asked by the shifted-context warm pass (its answer is never decoded)
WARM_QUESTION = "Describe the pictures."
FILLER_SENTENCES = (  # the unrelated system message that precedes the images in the shifted-context warm pass
    "Archive note from the municipal library, unrelated to any task.",
    "The reading room extended its opening hours for the winter season.",
    "Volunteers catalogued donated atlases and sorted periodicals by year.",
    "A lecture on the history of coastal lighthouses is planned for next month.",
    "The heating in the east wing was repaired after the storm in early March.",
    "Visitors are asked to return borrowed umbrellas to the stand by the door.",
)
MAX_FILLER_SENTENCES = 1000  # give up (a bug, not a data problem) if no filler this long reaches MIN_SHIFT

WarmKind = Literal["none", "same", "shifted"]


@dataclass(frozen=True)
class Arm:
    """One arm of the eval: how its stores are warmed and how its measured session reuses them."""

    name: str  # one of ARM_NAMES
    config: mmkv.SessionConfig  # the measured session's settings
    warm: WarmKind  # "none": no warm pass; "same": a pass over the same sample; "shifted": over a filler context


def make_arms(seam: int = 1) -> dict[str, Arm]:
    """All arms by name (``seam``: tokens recomputed per spliced image in ``kv`` and ``kv-shifted``)."""
    kv0 = mmkv.SessionConfig.of(reuse="kv", seam=0)
    repaired = {
        name: Arm(name, mmkv.SessionConfig.of(seam=seam if k is None else k, repair=repair, budget=budget), "shifted")
        for name, (k, repair, budget) in REPAIR_ARMS.items()
    }  # fmt: skip
    return repaired | {
        "none": Arm("none", mmkv.SessionConfig.of(reuse="none"), "none"),
        "encoder": Arm("encoder", mmkv.SessionConfig.of(reuse="encoder"), "same"),
        "kv": Arm("kv", mmkv.SessionConfig.of(reuse="kv", seam=seam), "same"),
        "kv-shifted": Arm("kv-shifted", mmkv.SessionConfig.of(reuse="kv", seam=seam), "shifted"),
        "kv-no-seam": Arm("kv-no-seam", kv0, "shifted"),
        "kv-temporal-only": Arm(
            "kv-temporal-only", mmkv.SessionConfig.of(reuse="kv", seam=0, rotate_axes=(0,)), "shifted"
        ),
        "kv-no-rotate": Arm(
            "kv-no-rotate", mmkv.SessionConfig.of(reuse="kv", seam=0, rotate=False), "shifted"
        ),
    }


# ------------------------------------------------------------------------------------------------ sessions
def build_session(
    handle: mmkv.ModelHandle,
    sample: Sample,
    config: mmkv.SessionConfig,
    store: KVStore,
    encoder_store: EncoderStore,
) -> mmkv.Session:
    """A fresh session holding ``sample``'s conversation (system text, then each turn's images and text); the
    question is not added."""
    return sample_session(handle, sample, store=store, encoder_store=encoder_store, config=config)


def image_starts(session: mmkv.Session, question: str) -> list[tuple[str, int]]:
    """``(digest, start position)`` of every image in the prompt ``session`` would run for ``question``, in prompt
    order (the temporal position of its ``<|vision_start|>``). Changes nothing."""
    layout = session.prompt_layout(question)
    return [
        (session.images[layout.image_of(piece)].digest, int(layout.positions[0, piece.begin]))
        for piece in layout.pieces
        if piece.kind == "image"
    ]


def _least_distance(targets: Sequence[tuple[str, int]], cached: Sequence[tuple[str, int]]) -> int | None:
    """The least ``|target - cached|`` over pairs of occurrences of the same image (None: no images)."""
    distances = [abs(t - c) for dt, t in targets for dc, c in cached if dt == dc]
    return min(distances) if distances else None


def shifted_warm_session(
    handle: mmkv.ModelHandle,
    sample: Sample,
    targets: Sequence[tuple[str, int]],
    store: KVStore,
    encoder_store: EncoderStore,
    min_shift: int = MIN_SHIFT,
) -> mmkv.Session:
    """A ``reuse="kv"`` session that shows ``sample``'s images (in order, back to back) after an unrelated system
    message just long enough that every image lands at least ``min_shift`` positions away from each of its
    ``targets`` (the sample's own image starts). Another context and other positions: its image KV is what the
    shifted arms splice. Nothing is run yet."""
    images = [image for turn in sample.turns for image in turn.images]
    for num_sentences in range(1, MAX_FILLER_SENTENCES + 1):
        filler = " ".join(FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(num_sentences))
        session = mmkv.Session(handle, store=store, encoder_store=encoder_store, reuse="kv")
        session.add_text(filler, role="system")
        for image in images:
            session.add_image(image)
        distance = _least_distance(targets, image_starts(session, WARM_QUESTION))
        if distance is None or distance >= min_shift:
            return session
    raise RuntimeError(
        f"no filler of up to {MAX_FILLER_SENTENCES} sentences moves the images {min_shift} away"
    )


# ------------------------------------------------------------------------------------------------- scoring
@dataclass(frozen=True)
class _Pass:
    """What one measured pass gave."""

    logits: torch.Tensor  # (vocab,) float32, first answer token
    ttft_s: float  # rendering to first-token logits (store writes excluded)
    answer: mmkv.Answer  # the decoded answer (asked after the logits, on the same session)
    sources: tuple[str, ...]  # where each image's KV / vision outputs came from in the timed call
    prompt_tokens: int  # tokens in the prompt
    prefilled_tokens: int  # prompt tokens the timed call ran through the language model
    repair: mmkv.runtime.RepairStats  # what the timed call recomputed of the spliced KV; the ranking's cost


def _measured_pass(session: mmkv.Session, question: str, max_new_tokens: int) -> _Pass:
    """First-token logits and their time from one ``next_token_logits`` call, then the greedy answer."""
    if session.handle.device.type == "cuda":
        torch.cuda.synchronize(session.handle.device)  # no warm-pass work left running into the timed call
    logits = session.next_token_logits(question)
    prefill = session.last_prefill
    answer = session.ask(question, max_new_tokens=max_new_tokens)
    sources = tuple(r.reused_from for r in prefill.images)
    return _Pass(logits, prefill.seconds, answer, sources, prefill.prompt_tokens, prefill.prefilled, prefill.repair)  # fmt: skip


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def _run_arm(
    handle: mmkv.ModelHandle, sample: Sample, arm: Arm, max_new_tokens: int
) -> tuple[_Pass, list[int] | None]:
    """Warm fresh stores as ``arm`` says, then measure a fresh session. Returns the pass and, for kv arms, the
    shift (placed start - cached start) of every image in prompt order."""
    store, encoder_store = KVStore(), EncoderStore()
    session = build_session(handle, sample, arm.config, store, encoder_store)
    targets = image_starts(session, sample.question)
    if arm.warm == "same":
        warm = build_session(
            handle, sample, mmkv.SessionConfig.of(reuse=arm.config.reuse), store, encoder_store
        )
        warm.next_token_logits(sample.question)
    elif arm.warm == "shifted":
        shifted_warm_session(handle, sample, targets, store, encoder_store).next_token_logits(WARM_QUESTION)
    shifts = None
    if arm.config.reuse == "kv":
        cached = {digest: store.get(digest, handle) for digest, _ in targets}
        assert all(segment is not None for segment in cached.values()), f"{arm.name}: warm pass stored no KV"
        shifts = [start - cached[digest].start for digest, start in targets]
        if arm.warm == "shifted":
            assert all(abs(s) >= MIN_SHIFT for s in shifts), f"{arm.name}: shifts {shifts} under {MIN_SHIFT}"
    result = _measured_pass(session, sample.question, max_new_tokens)
    if arm.warm != "none":
        assert all(s in ("memory", "disk") for s in result.sources), (
            f"{arm.name}: measured pass missed the warmed store ({result.sources})"
        )
    return result, shifts


def score_sample(
    handle: mmkv.ModelHandle,
    sample: Sample,
    arms: Sequence[str] = ARM_NAMES,
    seam: int = 1,
    max_new_tokens: int = 12,
) -> dict[str, dict]:
    """Run ``sample`` under ``none`` and each of ``arms``; one JSON-ready record per arm, scored against the
    expected answer and against ``none``. Each arm warms its own fresh stores; only measured passes are timed.

    Record fields: ``digest``, ``category``, ``arm``, ``question``, ``expected``, ``answer``,
    ``correct`` (normalised exact match), ``agree`` (normalised
    answer equals none's), ``cosine`` (first-token logits vs none, float64), ``top1_agree``, ``ttft_s``,
    ``none_ttft_s``, ``speedup`` (none / arm TTFT), ``prompt_tokens``, ``prefilled_tokens``, ``reused_tokens``
    (of the timed call), ``sources`` (per image), ``shifts`` (kv arms: placed start - cached start per image, in
    positions; else None), ``min_abs_shift`` and ``max_abs_shift``; ``image_tokens`` / ``image_recomputed`` (tokens
    of spliced images, and of those computed in context), ``repair_s`` / ``pass_tokens`` / ``pass_layers`` (the
    repair's ranking: time, tokens and layers of its pass).
    """
    unknown = set(arms) - set(ARM_NAMES)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {ARM_NAMES}")
    by_name = make_arms(seam)
    names = ["none", *(a for a in ARM_NAMES if a in arms and a != "none")]
    reference: _Pass | None = None
    records: dict[str, dict] = {}
    for name in names:
        result, shifts = _run_arm(handle, sample, by_name[name], max_new_tokens)
        reference = reference or result
        answer = normalise_answer(result.answer.text)
        shift_range = (min(map(abs, shifts)), max(map(abs, shifts))) if shifts else (None, None)
        records[name] = {
            "digest": sample.digest, "category": sample.category, "arm": name, "question": sample.question,
            "expected": sample.answer, "answer": result.answer.text,
            "correct": answer == normalise_answer(sample.answer),
            "agree": answer == normalise_answer(reference.answer.text),
            "cosine": _cosine(result.logits, reference.logits),
            "top1_agree": int(result.logits.argmax()) == int(reference.logits.argmax()),
            "ttft_s": result.ttft_s, "none_ttft_s": reference.ttft_s, "speedup": reference.ttft_s / result.ttft_s,
            "prompt_tokens": result.prompt_tokens, "prefilled_tokens": result.prefilled_tokens,
            "reused_tokens": result.prompt_tokens - result.prefilled_tokens, "sources": list(result.sources),
            "shifts": shifts, "min_abs_shift": shift_range[0], "max_abs_shift": shift_range[1],
            "image_tokens": result.repair.image_tokens, "image_recomputed": result.repair.image_recomputed,
            "repair_s": result.repair.seconds, "pass_tokens": result.repair.pass_tokens,
            "pass_layers": result.repair.pass_layers,
        }  # fmt: skip
    return records


# --------------------------------------------------------------------------------------------- aggregation
def aggregate(records: Sequence[dict], resamples: int = 1000, seed: int = 0) -> dict[str, dict[str, dict]]:
    """Per arm and category (and ``"all"``): ``n`` and ``VQA_METRICS`` (``evals/report.py``): ``accuracy`` and
    ``agreement`` (with none) with Wilson 95% intervals; ``cosine`` (mean first-token logit cosine with none),
    ``ttft_s`` (median), ``speedup`` (median none TTFT / median arm TTFT, paired per sample) and
    ``reused_fraction`` (prompt tokens not run through the model / prompt tokens, over the cell),
    ``image_recomputed`` (spliced images' tokens computed in context / their tokens) and ``repair_ms`` (median
    ranking time) with seeded bootstrap intervals (each metric only when the records hold its fields); and
    ``min_abs_shift`` / ``max_abs_shift`` (kv arms: the least / largest image shift over the cell's samples);
    ``delta_accuracy`` (the arm's accuracy minus none's on the same samples, bootstrap 95%) and, from
    ``evals/baselines.py``, ``chance`` (the best blind guesser's accuracy on the category), ``reference_accuracy``
    (none's) and ``at_chance`` (none's interval reaches chance: the category cannot tell whether reuse breaks
    anything). Pure (no model needed). Arms in ``ARM_NAMES`` order, categories in order of first appearance, then
    ``"all"``."""

    def shift(pick, key: str):
        return lambda cell: pick((r[key] for r in cell if r.get(key) is not None), default=None)

    extras = {"min_abs_shift": shift(min, "min_abs_shift"), "max_abs_shift": shift(max, "max_abs_shift")}
    paired = attach_reference(records)
    candidates = {**VQA_METRICS, "delta_accuracy": DELTA}
    metrics = {k: m for k, m in candidates.items() if all(key in r for r in paired for key in m.keys)}
    table = cells(paired, "arm", "category", metrics, resamples, seed, ARM_NAMES, extras)
    return mark_chance(table, records, "category")


# --------------------------------------------------------------------------------------------------- runs
def run(
    model: str | mmkv.ModelHandle = "tiny-qwen3-vl",
    n: int = 200,
    seed: int = 0,
    seam: int = 1,
    categories: Sequence[str] | None = None,
    arms: Sequence[str] | None = None,
    jsonl: str | Path | None = None,
    max_new_tokens: int = 12,
    device: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Evaluate ``arms`` (``none`` always runs) on ``n`` held-out samples per category (all categories unless
    ``jsonl`` is given; then its samples, category ``"custom"``, plus any ``categories`` named) and write
    ``results.json``, ``results.md`` and ``results.png`` to ``out``. Returns what ``results.json`` holds:
    ``settings``, ``records`` (one per sample and arm) and ``aggregate``.

    One untimed run of the first sample comes first, so that one-off start-up costs are not measured.
    """
    handle = model if isinstance(model, mmkv.ModelHandle) else mmkv.load(model, device=device)
    name = handle.name if isinstance(model, mmkv.ModelHandle) else str(model)
    if arms is not None and set(arms) - set(ARM_NAMES):
        raise ValueError(f"unknown arms {sorted(set(arms) - set(ARM_NAMES))}; choose from {ARM_NAMES}")
    arms = ARM_NAMES if arms is None else tuple(a for a in ARM_NAMES if a == "none" or a in arms)
    if categories is None:
        categories = () if jsonl is not None else CATEGORIES
    samples = [s for category in categories for s in make_samples(category, n, seed=seed)]
    if jsonl is not None:
        samples += load_jsonl(jsonl)
    if not samples:
        raise ValueError("no samples to evaluate: name --categories or give --jsonl")
    out = Path(out) if out is not None else default_out("vqa", name)
    out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    score_sample(handle, samples[0], arms, seam, max_new_tokens)  # warm-up, discarded
    records: list[dict] = []
    for sample in tqdm(samples, desc=f"vqa {name}", unit="sample", disable=not progress):
        records.extend(score_sample(handle, sample, arms, seam, max_new_tokens).values())
    table = aggregate(records, seed=seed)
    settings = {
        "model": name, "family": handle.family.name, "device": str(handle.device), "dtype": str(handle.dtype),
        "n": n, "seed": seed, "seam": seam, "categories": list(categories), "arms": list(arms),
        "jsonl": None if jsonl is None else str(jsonl), "max_new_tokens": max_new_tokens,
        "repair_arms": {a: dict(zip(("seam", "repair", "budget"), v, strict=True)) for a, v in REPAIR_ARMS.items()},
        "num_samples": len(samples), "min_shift": MIN_SHIFT, "bootstrap_resamples": 1000,
        "interval": "wilson (accuracy, agreement), bootstrap (others)", "seconds": time.perf_counter() - started,
        "median_none_ttft_s": statistics.median(r["ttft_s"] for r in records if r["arm"] == "none"),
    }  # fmt: skip
    results = {"settings": settings, "records": records, "aggregate": table}
    header = (
        f"# VQA eval: {name}\n\n{len(samples)} samples, arms against full recompute (`none`), seam {seam}, "
        f"{handle.device} {handle.dtype}; 95% intervals in brackets (Wilson for accuracy and agreement, "
        "bootstrap for the rest); `reused`: the fraction of prompt tokens spliced, not recomputed; `img recomputed`: "
        "the share of spliced images' tokens computed in context (seam and repair); `chance`: the best blind "
        "guesser's accuracy (evals/baselines.py), `(at chance)`: none's accuracy cannot be told from it, so that "
        "category cannot show whether reuse breaks anything; `acc - none acc`: paired, per sample.\n\n"
    )
    title = f"{name}: {len(samples)} samples"
    write_results(out, results, header, vqa_markdown(table), lambda p: vqa_plot(table, p, title=title))
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line (parsed only under ``__main__``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl", help="any name mmkv.load understands")
    parser.add_argument("--n", type=int, default=200, help="samples per category")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seam", type=int, default=1, help="tokens recomputed per spliced image (kv arms)")
    parser.add_argument("--categories", nargs="+", choices=CATEGORIES, default=None)
    parser.add_argument("--arms", nargs="+", choices=ARM_NAMES, default=None, help="none always runs")
    parser.add_argument(
        "--jsonl", default=None, help="your own tasks (category 'custom'); see evals/tasks.py"
    )
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="output folder (default runs/vqa-<model>)")
    return parser


if __name__ == "__main__":
    script_main("evals/vqa.py", build_parser(), run, vqa_markdown)
