"""The compose eval: does a decision stay the same when the text that governs it is a precompiled segment?

The decision text is the agentic task's policy (``evals/tasks.py``: the ``account_role`` field and the rule
that turns a status badge into a tool call). A *preamble* (``--shifts`` tokens long: 64, 256, 1024, 2048 by
default, in one of ``--texts`` styles: ``notes`` of earlier steps, an ``archive`` of unrelated library notes, a
``log`` of tool calls and results; samples take the shifts and styles in turn) moves it away from where it was
computed, in one of two directions (``--directions``):

- ``use`` (shift > 0): the policy is precompiled once per role right after the system message's opening (as a
  session would compute it first) and spliced into a system message that begins with the preamble, so it lands
  after a context it never saw;
- ``compile`` (shift < 0): the policy is precompiled after the preamble and spliced where the task puts it, at
  the start of the system message; the model then sees the prompt it was trained on, so its own decisions are
  meaningful (the small checkpoints never saw text before the policy, and with a long preamble their full
  recompute itself decides badly).

Every sample is scored in both directions. The screen's state follows, shown as a panel (``--gates screen``)
or said in words (``text``). Arms, each in a fresh session:

- ``full``: everything computed (``reuse="none"``, the policy as plain text); the reference;
- ``splice s=K``: the segment spliced, re-rotated to its new positions, its first ``K`` tokens recomputed in the
  new context (``--seams``, 0 1 4 16 by default);
- ``no-rotate s=K``: the same without re-rotation (the control: what a position-blind splice does);
- ``<repair> B% s=K``: spliced with seam ``K`` (``--repair-seam``, 1) and a repair beyond it (``--repairs``:
  ``seam`` the next tokens, ``deviation`` those whose layer-1 KV moves most in the new context, ``attention``
  those the question attends to most; ``TurnPolicy.repair``), ``B`` percent of the segment's other tokens
  (``--budgets``, 5% by default);
- ``patch r=R s=K`` (``use`` direction only): the segment with a stored low-rank correction (``SegmentPatch``,
  Kamera's idea; rank ``--patch-rank``, 4), fitted on its KV as computed after calibration preambles of the
  *other* styles (256 and 1024 tokens, seeds no test preamble uses), spliced with seam ``K``;
- ``erratum`` / ``suffix``: the unified edit+compose case. The segment compiled with the *other* role is spliced
  (seam 1), the context prefilled, then the field is edited to the sample's role by an appended erratum or
  by recomputing from the field on (``Session.edit``); scored against ``full`` with the sample's role.

Per arm and gate (and per shift, by the requested length: + spliced after the preamble, - compiled after it;
and per preamble style): decision agreement with ``full``, accuracy (the task's correct call), first-token logit
cosine with ``full``, the fraction of the prompt run through the model (the rest spliced), the share of the
segment computed in context (seam and repair), the time to first token (host, ``last_prefill.seconds``) and the
speedup over ``full`` (paired per sample), the repair's ranking time; Wilson 95% intervals for proportions,
bootstrap for the rest. ``--kinds`` picks the arm kinds (all by default). For the edit arms an earlier turn built the context (untimed), and the fraction and the
time are those of the turn that edits and asks (the edit's recomputation plus the question). Writes
``results.json``, ``results.md`` and ``results.png`` to ``--out`` (default ``runs/compose-<model>``). Scoring a
sample (``score_sample``) is kept apart from aggregating (``aggregate``), like ``evals/vqa.py``.

    python evals/compose.py --model small-qwen3-vl
    python evals/compose.py --model tiny-qwen2.5-vl --n 4 --shifts 64 --seams 0 1
    python evals/compose.py --model small-qwen3-vl --n 96 --seed 5077 --kinds full splice repair \
        --seams 0 1 16 --repairs seam deviation attention --budgets 0.05 0.25 --directions compile use
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mmkv  # noqa: E402
from evals.baselines import mark_chance  # noqa: E402
from evals.edit import FLIP, GATES, TEMPLATE, edit_samples  # noqa: E402
from evals.preambles import STYLES, calibration_texts, make_preamble  # noqa: E402
from evals.report import (  # noqa: E402
    COMPOSE_METRICS,
    cells,
    compose_markdown,
    compose_plot,
    default_out,
    script_main,
    write_results,
)
from evals.sample import Sample  # noqa: E402
from evals.tasks import AGENTIC_FIELD, AGENTIC_QUESTION, add_turns, normalise_answer  # noqa: E402
from mmkv.cli import HelpFormatter  # noqa: E402
from mmkv.runtime.patch import fit_patch  # noqa: E402

__all__ = ["KINDS", "aggregate", "arm_names", "compose_samples", "repair_arm", "run", "score_sample"]

KINDS = ("full", "splice", "no-rotate", "repair", "patch", "erratum", "suffix")
EDIT_SEAM = 1  # the seam of the edit arms' splice
SHORT = {"seam": "seam", "deviation": "dev", "attention": "att"}  # repair -> arm label


def arm_names(seams: Sequence[int], repairs: Sequence[tuple[str, float]] = (), repair_seam: int = 1,
              kinds: Sequence[str] = KINDS, patch_rank: int = 4) -> list[str]:  # fmt: skip
    """The arm labels in report order: ``full``, ``splice s=K`` and ``no-rotate s=K`` per seam, each repair
    (``repair_arm``), the patch, the edit arms; only those of ``kinds``."""
    names = [("full", "full")]
    names += [(k, f"{k} s={s}") for k in ("splice", "no-rotate") for s in seams]
    names += [("repair", repair_arm(r, b, repair_seam)) for r, b in repairs]
    names += [("patch", f"patch r={patch_rank} s={repair_seam}")]
    names += [("erratum", "erratum"), ("suffix", "suffix")]
    return [name for kind, name in names if kind in kinds]


def repair_arm(repair: str, budget: float, seam: int) -> str:
    """The label of a repair arm: ``"dev 5% s=1"``."""
    return f"{SHORT[repair]} {100 * budget:g}% s={seam}"


def compose_samples(gate: str, n: int, seed: int = 0) -> list[tuple[Sample, str]]:
    """``n`` held-out samples of ``gate`` without an erratum of their own, each with its policy's role."""
    return edit_samples(gate, n, seed, flips=False)


def _session(handle: mmkv.ModelHandle, kind: str, repair: tuple[str, float] | None) -> mmkv.Session:
    settings = {"reuse": "none" if kind == "full" else "kv", "rotate": kind != "no-rotate"}
    if repair is not None:
        settings |= {"repair": repair[0], "budget": repair[1]}
    return mmkv.Session(handle, config=mmkv.SessionConfig.of(**settings))


def score_sample(
    handle: mmkv.ModelHandle,
    sample: Sample,
    role: str,
    gate: str,
    preamble: str,
    segments: dict[str, mmkv.text.TextSegment],
    seams: Sequence[int],
    shift: int = 0,
    repairs: Sequence[tuple[str, float]] = (),
    repair_seam: int = 1,
    kinds: Sequence[str] = KINDS,
    labels: dict | None = None,
    patched: tuple[str, dict[str, mmkv.text.TextSegment]] | None = None,
) -> list[dict]:
    """One record per arm (``arm_names(seams, repairs, repair_seam, kinds)``) for ``sample`` with the policy after
    ``preamble`` (text at the start of the system message; may be ``""``). ``segments`` maps each role to the
    policy precompiled with it; ``shift`` (recorded) is how far the segment moved: the preamble's tokens, or minus
    the tokens it was compiled after. ``labels`` (recorded as they are) tell the record's cell: the requested
    shift, the preamble style. ``patched``: the patch arm's label and its corrected segment per role (no patch
    arm without it)."""
    runs = [("full", 0, None)] + [(k, s, None) for k in ("splice", "no-rotate") for s in seams]
    runs += [("repair", repair_seam, r) for r in repairs] + (
        [("patch", repair_seam, None)] if patched else []
    )
    runs += [("erratum", EDIT_SEAM, None), ("suffix", EDIT_SEAM, None)]
    results = {}
    for kind, seam, repair in (run for run in runs if run[0] in kinds or run[0] == "full"):
        session = _session(handle, kind, repair)
        if preamble:
            session.add_text(preamble, "system")
        seconds = 0.0
        if kind == "full":
            session.add_text(TEMPLATE, "system", {AGENTIC_FIELD: role})
        elif kind in ("splice", "no-rotate", "repair", "patch"):
            session.add_segment((patched[1] if kind == "patch" else segments)[role], seam=seam, role="system")
        else:  # the other role spliced and prefilled, then edited to this sample's role
            session.add_segment(segments[FLIP[role]], seam=seam, role="system")
        add_turns(session, sample)
        computed = 0
        if kind in ("erratum", "suffix"):  # an earlier turn built the context; this turn edits and asks
            session.prefill()
            report = session.edit(AGENTIC_FIELD, role, kind)
            seconds, computed = report.seconds, report.recomputed
        logits = session.next_token_logits(AGENTIC_QUESTION)  # (V,)
        stats = session.last_prefill
        answer = normalise_answer(session.ask(AGENTIC_QUESTION, max_new_tokens=8).text)
        results[(kind, seam, repair)] = {
            "answer": answer,
            "logits": logits,
            "ttft_s": seconds + stats.seconds,
            "fraction": (computed + stats.prefilled) / stats.prompt_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "segment_tokens": segments[FLIP[role] if kind in ("erratum", "suffix") else role].length,
            "repair": stats.repair,
        }
    reference = results[("full", 0, None)]
    records = []
    for (kind, seam, repair), r in results.items():
        label = {
            "splice": f"splice s={seam}",
            "no-rotate": f"no-rotate s={seam}",
            "patch": patched and patched[0],
        }
        label = label.get(kind) or kind
        records.append(
            {
                "arm": repair_arm(*repair, seam) if repair else label,
                "kind": kind,
                "seam": seam,
                "repair": repair[0] if repair else None,
                "budget": repair[1] if repair else None,
                "gate": gate,
                "shift": shift,
                **(labels or {}),
                "sample": sample.digest[:16],
                "answer": r["answer"],
                "expected": sample.answer,
                "correct": r["answer"] == sample.answer,
                "agree": r["answer"] == reference["answer"],
                "cosine": float(F.cosine_similarity(r["logits"], reference["logits"], dim=0)),
                "fraction": r["fraction"],
                "prompt_tokens": r["prompt_tokens"],
                "segment_tokens": 0 if kind == "full" else r["segment_tokens"],
                "segment_recomputed": r["repair"].recomputed
                if kind not in ("full", "erratum", "suffix")
                else 0,
                "repair_s": r["repair"].seconds,
                "pass_tokens": r["repair"].pass_tokens,
                "ttft_s": r["ttft_s"],
                "full_ttft_s": reference["ttft_s"],
            }
        )
    return records


def aggregate(
    records: Sequence[dict], by: str = "gate", resamples: int = 1000, seed: int = 0, arms: Sequence[str] = ()
) -> dict:
    """Per arm (``arms`` first, then the others in ``records``' order of first appearance) and value of ``by`` (``"gate"``, ``"shift"``,
    ``"target"`` (the requested shift, signed), ``"style"``; and ``"all"``): ``n`` and each of ``COMPOSE_METRICS``
    whose fields the records hold (Wilson 95% for agreement and accuracy, seeded bootstrap for the rest), and
    ``chance`` / ``at_chance`` against full recompute's accuracy (``evals/baselines.py``). Pure."""
    metrics = {k: m for k, m in COMPOSE_METRICS.items() if all(key in r for r in records for key in m.keys)}
    return mark_chance(cells(records, "arm", by, metrics, resamples, seed, arms), records, by, reference="full")


def run(
    model: str | mmkv.ModelHandle = "small-qwen3-vl",
    n: int = 100,
    seed: int = 0,
    shifts: Sequence[int] = (64, 256, 1024, 2048),
    seams: Sequence[int] = (0, 1, 4, 16),
    gates: Sequence[str] = ("text", "screen"),
    directions: Sequence[str] = ("use", "compile"),
    texts: Sequence[str] = STYLES,
    repairs: Sequence[str] = ("seam", "deviation", "attention"),
    budgets: Sequence[float] = (0.05,),
    repair_seam: int = 1,
    kinds: Sequence[str] = KINDS,
    patch_rank: int = 4,
    device: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Score every arm on ``n`` samples per gate (shifts and preamble styles taken in turn); write and return the
    results."""
    if set(gates) - set(GATES) or not gates:
        raise ValueError(f"gates must be among {sorted(GATES)}, got {list(gates)}")
    if not directions or set(directions) - {"use", "compile"}:
        raise ValueError(f"directions must be among 'use', 'compile', got {list(directions)}")
    if not shifts or min(shifts) < 0 or not seams or min(seams) < 0:
        raise ValueError(f"shifts and seams must be non-empty and >= 0, got {list(shifts)}, {list(seams)}")
    if not texts or set(texts) - set(STYLES) or set(kinds) - set(KINDS) or "full" not in kinds:
        raise ValueError(
            f"texts among {STYLES} and kinds among {KINDS} (with full), got {list(texts)}, {list(kinds)}"
        )
    arms_repaired = [(r, float(b)) for r in repairs for b in budgets] if "repair" in kinds else []
    mmkv.runtime.TurnPolicy(seam=repair_seam)  # refuse a bad seam before any work
    for repair, budget in arms_repaired:
        mmkv.runtime.TurnPolicy(repair=repair, budget=budget)  # refuse a bad repair or budget before any work
    handle = model if isinstance(model, mmkv.ModelHandle) else mmkv.load(model, device=device)
    name = handle.name if isinstance(model, mmkv.ModelHandle) else str(model)
    out = Path(out) if out is not None else default_out("compose", name)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = handle.processor.tokenizer
    cases = [(s, t) for t in texts for s in shifts]  # (requested shift, preamble style): shifts vary fastest
    preambles = {(s, t): make_preamble(tokenizer, s, seed + s + 7919 * STYLES.index(t), t) for s, t in cases}
    tokens = {case: len(tokenizer(text)["input_ids"]) if text else 0 for case, text in preambles.items()}
    work = [
        (gate, sample, role, cases[i % len(cases)])
        for gate in gates
        for i, (sample, role) in enumerate(compose_samples(gate, n, seed))
    ]
    with torch.inference_mode():
        opening = mmkv.text.canonical_preamble(handle, "system")
        compile_cases = cases if "compile" in directions else []

        def compiled(after: str, role: str) -> mmkv.text.TextSegment:
            return mmkv.text.precompile(
                handle, TEMPLATE, {AGENTIC_FIELD: role}, role="system", preamble=after
            )

        segments = {("use", None, r): compiled(opening, r) for r in FLIP} if "use" in directions else {}
        segments |= {
            ("compile", c, r): compiled(opening + preambles[c], r) for c in compile_cases for r in FLIP
        }
        fitting = time.perf_counter()
        patched = {}  # style -> role -> the use direction's segment corrected by a patch fitted on other styles
        if "patch" in kinds and "use" in directions:
            for style in texts:
                calibration = calibration_texts(tokenizer, style, seed=seed)
                patched[style] = {
                    r: fit_patch(segments[("use", None, r)], [compiled(opening + c, r) for c in calibration], patch_rank)
                    .apply(segments[("use", None, r)])
                    for r in FLIP
                }  # fmt: skip
        fitting = time.perf_counter() - fitting

        def score(gate, sample, role, case, where) -> list[dict]:
            mine = {r: segments[(where, None if where == "use" else case, r)] for r in FLIP}
            sign = 1 if where == "use" else -1
            labels = {"target": sign * case[0], "style": case[1]}
            preamble = (
                preambles[case] if where == "use" else ""
            )  # use: spliced after it; compile: compiled after
            label = f"patch r={patch_rank} s={repair_seam}"
            patch = (
                (label, patched[case[1]]) if preamble and patched else None
            )  # a patch corrects a moved segment
            return score_sample(handle, sample, role, gate, preamble, mine, seams, sign * tokens[case],
                                arms_repaired, repair_seam, kinds, labels, patch)  # fmt: skip

        score(*work[0], directions[0])  # warm-up, discarded
        records = []
        for gate, sample, role, case in tqdm(
            work, desc=f"compose {name}", unit="sample", disable=not progress
        ):
            for where in directions:
                records.extend(score(gate, sample, role, case, where))
    names = arm_names(
        seams, arms_repaired, repair_seam, kinds if patched else set(kinds) - {"patch"}, patch_rank
    )
    by_gate, by_target, by_style = (
        aggregate(records, by, seed=seed, arms=names) for by in ("gate", "target", "style")
    )
    results = {
        "settings": {
            "model": name, "family": handle.family.name, "device": str(handle.device), "dtype": str(handle.dtype),
            "n": n, "seed": seed, "shifts": list(shifts), "seams": list(seams), "gates": list(gates),
            "directions": list(directions), "texts": list(texts), "repairs": list(repairs), "budgets": list(budgets),
            "repair_seam": repair_seam, "kinds": list(kinds), "arms": names, "patch_rank": patch_rank,
            "patch_fit_seconds": fitting,
            "preamble_tokens": {f"{s} {t}": tokens[(s, t)] for s, t in cases},
            "segment_tokens": {r: next(v.length for k, v in segments.items() if k[2] == r) for r in FLIP},
            "num_samples": len(work), "seconds": time.perf_counter() - started,
        },
        "records": records,
        "aggregate": by_gate,
        "by_shift": by_target,
        "by_style": by_style,
    }  # fmt: skip
    header = (
        f"# Compose eval: {name}\n\n{len(work)} samples x {len(directions)} directions; the policy "
        f"({results['settings']['segment_tokens']['admin']} tokens with `admin`) precompiled once per role "
        f"and preamble, moved by preambles of {', '.join(map(str, shifts))} tokens in {len(texts)} styles "
        f"({', '.join(texts)}): shift > 0 spliced after the preamble, shift < 0 compiled after it and spliced at "
        "the message's start; arms against `full`, 95% intervals in brackets (Wilson for proportions, bootstrap "
        "otherwise); `segment recomputed`: the share of the segment computed in context (seam and repair); "
        "`(at chance)`: full recompute's accuracy cannot be told from the best blind guess (evals/baselines.py).\n\n"
    )
    markdown = (
        compose_markdown(by_gate) + "\n\n## By shift (requested tokens; + spliced after, - compiled after)\n\n"
        + compose_markdown(by_target, "shift") + "\n\n## By preamble style\n\n" + compose_markdown(by_style, "style")
    )  # fmt: skip
    title = f"{name}: precompiled policy spliced, {len(work)} samples"
    write_results(out, results, header, markdown, lambda p: compose_plot(by_target, p, title=title))
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--n", type=int, default=100, help="samples per gate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shifts", type=int, nargs="+", default=[64, 256, 1024, 2048], help="preamble tokens"
    )
    parser.add_argument("--seams", type=int, nargs="+", default=[0, 1, 4, 16], help="tokens recomputed")
    parser.add_argument("--gates", nargs="+", choices=sorted(GATES), default=["text", "screen"])
    parser.add_argument(
        "--directions", nargs="+", choices=["use", "compile"], default=["use", "compile"],
        help="where the preamble goes: before the splice (use) or before the precompiled text (compile)",
    )  # fmt: skip
    parser.add_argument("--texts", nargs="+", choices=STYLES, default=list(STYLES), help="preamble styles")
    parser.add_argument("--repairs", nargs="+", choices=list(SHORT), default=list(SHORT), help="repair arms")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.05], help="each repair arm's budget")
    parser.add_argument("--repair-seam", type=int, default=1, help="the seam under the repair arms")
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="arm kinds (full always)"
    )
    parser.add_argument(
        "--patch-rank", type=int, default=4, help="rank of the patch arm's correction per layer"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda; cuda when available if omitted")
    parser.add_argument("--out", default=None, help="output folder (default runs/compose-<model>)")
    return parser


if __name__ == "__main__":
    script_main("evals/compose.py", build_parser(), run, compose_markdown)
