"""The compose eval: does a decision stay the same when the text that governs it is a precompiled segment?

The decision text is the agentic task's policy (``evals/tasks.py``: the ``account_role`` field and the rule
that turns a status badge into a tool call). A *preamble* (notes of varied content, ``--shifts`` tokens long:
64, 256, 1024 by default) moves it away from where it was computed, in one of two directions (``--directions``):

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
- ``erratum`` / ``suffix``: the unified edit+compose case. The segment compiled with the *other* role is spliced
  (seam 1), the context prefilled, then the field is edited to the sample's role by an appended erratum or
  by recomputing from the field on (``Session.edit``); scored against ``full`` with the sample's role.

Per arm and gate (and per shift): decision agreement with ``full``, accuracy (the task's correct call),
first-token logit cosine with ``full``, the fraction of the prompt run through the model (the rest spliced),
the time to first token (host, ``last_prefill.seconds``) and the speedup over ``full`` (paired per sample), with
bootstrap 95% intervals. For the edit arms an earlier turn built the context (untimed), and the fraction and the
time are those of the turn that edits and asks (the edit's recomputation plus the question). Writes
``results.json``, ``results.md`` and ``results.png`` to ``--out`` (default ``runs/compose-<model>``). Scoring a
sample (``score_sample``) is kept apart from aggregating (``aggregate``), like ``evals/vqa.py``.

    python evals/compose.py --model small-qwen3-vl
    python evals/compose.py --model tiny-qwen2.5-vl --n 4 --shifts 64 --seams 0 1
"""

from __future__ import annotations

import argparse
import random
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
from evals.edit import FLIP, GATES, TEMPLATE, edit_samples  # noqa: E402
from evals.report import (  # noqa: E402
    COMPOSE_METRICS,
    cells,
    compose_markdown,
    compose_plot,
    default_out,
    script_main,
    write_results,
)
from evals.tasks import (  # noqa: E402
    AGENTIC_FIELD,
    AGENTIC_QUESTION,
    Sample,
    add_turns,
    normalise_answer,
)
from mmkv.cli import HelpFormatter  # noqa: E402

__all__ = ["KINDS", "aggregate", "arm_names", "compose_samples", "make_preamble", "run", "score_sample"]

KINDS = ("full", "splice", "no-rotate", "erratum", "suffix")
EDIT_SEAM = 1  # the seam of the edit arms' splice
_PAGES = ("settings", "billing", "inbox", "reports", "profile", "search results", "audit log", "dashboard")
_ACTS = ("opened", "scrolled", "closed", "refreshed", "filtered", "exported", "reviewed", "bookmarked")


def arm_names(seams: Sequence[int]) -> list[str]:
    """The arm labels in report order: ``full``, ``splice s=K`` and ``no-rotate s=K`` per seam, the edit arms."""
    return ["full", *[f"{k} s={s}" for k in ("splice", "no-rotate") for s in seams], "erratum", "suffix"]


def make_preamble(tokenizer, tokens: int, seed: int) -> str:
    """Notes of a previous session (varied pages, actions, numbers; seeded), at least ``tokens`` tokens long as
    ``tokenizer`` counts them, ending with a blank line. ``tokens`` 0 gives ``""``."""
    if tokens <= 0:
        return ""
    rng, lines = random.Random(seed), ["Notes from earlier steps."]
    while len(tokenizer("\n".join(lines))["input_ids"]) < tokens:
        lines.append(
            f"Step {len(lines)}: {rng.choice(_ACTS)} the {rng.choice(_PAGES)} page; "
            f"{rng.randint(0, 99)} items, {rng.choice(('none', 'one', 'two'))} flagged, id {rng.randint(1000, 9999)}."
        )
    return "\n".join(lines) + "\n\n"


def compose_samples(gate: str, n: int, seed: int = 0) -> list[tuple[Sample, str]]:
    """``n`` held-out samples of ``gate`` without an erratum of their own, each with its policy's role."""
    return edit_samples(gate, n, seed, flips=False)


def _session(handle: mmkv.ModelHandle, kind: str) -> mmkv.Session:
    config = mmkv.SessionConfig.of(reuse="none" if kind == "full" else "kv", rotate=kind != "no-rotate")
    return mmkv.Session(handle, config=config)


def score_sample(
    handle: mmkv.ModelHandle,
    sample: Sample,
    role: str,
    gate: str,
    preamble: str,
    segments: dict[str, mmkv.text.TextSegment],
    seams: Sequence[int],
    shift: int = 0,
) -> list[dict]:
    """One record per arm (``arm_names(seams)``) for ``sample`` with the policy after ``preamble`` (text at the
    start of the system message; may be ``""``). ``segments`` maps each role to the policy precompiled with it;
    ``shift`` (recorded) is how far the segment moved: the preamble's tokens, or minus the tokens it was compiled
    after."""
    runs = [("full", 0)] + [(k, s) for k in ("splice", "no-rotate") for s in seams]
    runs += [("erratum", EDIT_SEAM), ("suffix", EDIT_SEAM)]
    results = {}
    for kind, seam in runs:
        session = _session(handle, kind)
        if preamble:
            session.add_text(preamble, "system")
        seconds = 0.0
        if kind == "full":
            session.add_text(TEMPLATE, "system", {AGENTIC_FIELD: role})
        elif kind in ("splice", "no-rotate"):
            session.add_segment(segments[role], seam=seam, role="system")
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
        results[(kind, seam)] = {
            "answer": answer,
            "logits": logits,
            "ttft_s": seconds + stats.seconds,
            "fraction": (computed + stats.prefilled) / stats.prompt_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "segment_tokens": segments[role if kind in ("splice", "no-rotate") else FLIP[role]].length,
        }
    reference = results[("full", 0)]
    records = []
    for (kind, seam), r in results.items():
        records.append(
            {
                "arm": kind if kind in ("full", "erratum", "suffix") else f"{kind} s={seam}",
                "kind": kind,
                "seam": seam,
                "gate": gate,
                "shift": shift,
                "sample": sample.digest[:16],
                "answer": r["answer"],
                "correct": r["answer"] == sample.answer,
                "agree": r["answer"] == reference["answer"],
                "cosine": float(F.cosine_similarity(r["logits"], reference["logits"], dim=0)),
                "fraction": r["fraction"],
                "prompt_tokens": r["prompt_tokens"],
                "segment_tokens": 0 if kind == "full" else r["segment_tokens"],
                "ttft_s": r["ttft_s"],
                "full_ttft_s": reference["ttft_s"],
            }
        )
    return records


def aggregate(records: Sequence[dict], by: str = "gate", resamples: int = 1000, seed: int = 0) -> dict:
    """Per arm (in ``records``' order of first appearance) and value of ``by`` (``"gate"`` or ``"shift"``; and
    ``"all"``): ``n`` and each of ``COMPOSE_METRICS`` (Wilson 95% for agreement and accuracy, seeded bootstrap
    for the rest). Pure."""
    return cells(records, "arm", by, COMPOSE_METRICS, resamples, seed)


def run(
    model: str | mmkv.ModelHandle = "small-qwen3-vl",
    n: int = 100,
    seed: int = 0,
    shifts: Sequence[int] = (64, 256, 1024),
    seams: Sequence[int] = (0, 1, 4, 16),
    gates: Sequence[str] = ("text", "screen"),
    directions: Sequence[str] = ("use", "compile"),
    device: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Score every arm on ``n`` samples per gate (shifts taken in turn); write and return the results."""
    if set(gates) - set(GATES) or not gates:
        raise ValueError(f"gates must be among {sorted(GATES)}, got {list(gates)}")
    if not directions or set(directions) - {"use", "compile"}:
        raise ValueError(f"directions must be among 'use', 'compile', got {list(directions)}")
    if not shifts or min(shifts) < 0 or not seams or min(seams) < 0:
        raise ValueError(f"shifts and seams must be non-empty and >= 0, got {list(shifts)}, {list(seams)}")
    handle = model if isinstance(model, mmkv.ModelHandle) else mmkv.load(model, device=device)
    name = handle.name if isinstance(model, mmkv.ModelHandle) else str(model)
    out = Path(out) if out is not None else default_out("compose", name)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = handle.processor.tokenizer
    preambles = {s: make_preamble(tokenizer, s, seed + s) for s in shifts}
    tokens = {s: len(tokenizer(text)["input_ids"]) if text else 0 for s, text in preambles.items()}
    work = [
        (gate, sample, role, shifts[i % len(shifts)])
        for gate in gates
        for i, (sample, role) in enumerate(compose_samples(gate, n, seed))
    ]
    with torch.inference_mode():
        opening = mmkv.text.canonical_preamble(handle, "system")
        segments = {
            (where, s, r): mmkv.text.precompile(
                handle, TEMPLATE, {AGENTIC_FIELD: r}, role="system",
                preamble=opening + preambles[s] if where == "compile" else None,
            )
            for where in directions for s in shifts for r in FLIP
        }  # fmt: skip

        def score(gate, sample, role, shift, where) -> list[dict]:
            mine = {r: segments[(where, shift, r)] for r in FLIP}
            if where == "use":  # compiled at the message's start, spliced after the preamble
                return score_sample(handle, sample, role, gate, preambles[shift], mine, seams, tokens[shift])
            return score_sample(handle, sample, role, gate, "", mine, seams, -tokens[shift])  # the reverse

        score(*work[0], directions[0])  # warm-up, discarded
        records = []
        for gate, sample, role, shift in tqdm(
            work, desc=f"compose {name}", unit="sample", disable=not progress
        ):
            for where in directions:
                records.extend(score(gate, sample, role, shift, where))
    by_gate, by_shift = aggregate(records, "gate", seed=seed), aggregate(records, "shift", seed=seed)
    results = {
        "settings": {
            "model": name,
            "family": handle.family.name,
            "device": str(handle.device),
            "dtype": str(handle.dtype),
            "n": n,
            "seed": seed,
            "shifts": list(shifts),
            "seams": list(seams),
            "gates": list(gates),
            "directions": list(directions),
            "segment_tokens": {r: segments[(directions[0], shifts[0], r)].length for r in FLIP},
            "num_samples": len(work),
            "seconds": time.perf_counter() - started,
        },
        "records": records,
        "aggregate": by_gate,
        "by_shift": by_shift,
    }
    header = (
        f"# Compose eval: {name}\n\n{len(work)} samples x {len(directions)} directions; the policy "
        f"({segments[(directions[0], shifts[0], 'admin')].length} tokens with `admin`) precompiled once per role "
        f"and preamble, moved by preambles of {', '.join(map(str, shifts))} tokens: shift > 0 spliced after the "
        "preamble, shift < 0 compiled after it and spliced at the message's start (actual token counts in the "
        "shift column); arms against `full`, 95% intervals in brackets (Wilson for proportions, bootstrap otherwise).\n\n"
    )
    markdown = compose_markdown(by_gate) + "\n\n## By shift\n\n" + compose_markdown(by_shift, "shift")
    title = f"{name}: precompiled policy spliced, {len(work)} samples"
    write_results(out, results, header, markdown, lambda p: compose_plot(by_shift, p, title=title))
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--n", type=int, default=100, help="samples per gate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shifts", type=int, nargs="+", default=[64, 256, 1024], help="preamble tokens")
    parser.add_argument("--seams", type=int, nargs="+", default=[0, 1, 4, 16], help="tokens recomputed")
    parser.add_argument("--gates", nargs="+", choices=sorted(GATES), default=["text", "screen"])
    parser.add_argument(
        "--directions", nargs="+", choices=["use", "compile"], default=["use", "compile"],
        help="where the preamble goes: before the splice (use) or before the precompiled text (compile)",
    )  # fmt: skip
    parser.add_argument("--device", default=None, help="cpu or cuda; cuda when available if omitted")
    parser.add_argument("--out", default=None, help="output folder (default runs/compose-<model>)")
    return parser


if __name__ == "__main__":
    script_main("evals/compose.py", build_parser(), run, compose_markdown)
