"""The edit eval: does a model's field-gated decision follow a field changed in its cached context?

The gated-decision task is the agentic one (``evals/tasks.py``): a policy with a mutable field
(``account_role``), a gate (a red status badge) shown in a screenshot (``--gates screen``) or said in words
(``text``), and a one-line tool call as the answer. Only held-out samples with a red badge are used, so every
edit (admin <-> viewer) flips the correct call (``click(approve)`` <-> ``escalate(ticket)``).

Per sample, each arm starts from the context prefilled with the old value, changes the field, and answers:

- ``ignored``: no edit (what a stale cache decides; the floor);
- ``erratum``, ``in_place``, ``selective`` (``--k`` tokens by attention), ``selective-deviation`` (``--k`` by
  layer-1 KV deviation, the CacheBlend-style baseline), ``suffix``, ``full``: the ``mmkv.text`` strategies;
  ``full`` is the reference.

Per arm and gate: accuracy (the new value's call), agreement with ``full``, ``follows_old`` (the old value's
call), first-token logit cosine with ``full``, fraction of the context recomputed and edit time, with 95%
intervals (Wilson for the proportions, bootstrap for the rest; ``evals/report.py``). Samples are distinct. Writes ``results.json``, ``results.md`` and ``results.png`` to ``--out``
(default ``runs/edit-<model>``). Scoring a sample (``score_sample``) is kept apart from aggregating.

    python evals/edit.py --model small-qwen3-vl
    python evals/edit.py --model tiny-qwen3-vl --n 10 --gates text
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
from evals.report import (  # noqa: E402
    EDIT_METRICS,
    cells,
    default_out,
    edit_markdown,
    edit_plot,
    script_main,
    write_results,
)
from evals.sample import Sample  # noqa: E402
from evals.tasks import (  # noqa: E402
    AGENTIC_FIELD,
    AGENTIC_POLICY,
    AGENTIC_QUESTION,
    add_turns,
    iter_samples,
    normalise_answer,
)
from mmkv.cli import HelpFormatter  # noqa: E402

__all__ = ["ARM_NAMES", "GATES", "aggregate", "edit_samples", "run", "score_sample"]

ARM_NAMES = ("ignored", "erratum", "in_place", "selective", "selective-deviation", "suffix", "full")
GATES = {"screen": "agentic", "text": "agentic_text"}  # gate -> the task category that shows it that way
FLIP = {"admin": "viewer", "viewer": "admin"}
ANSWER = {"admin": "click(approve)", "viewer": "escalate(ticket)"}  # under a red badge
TEMPLATE = AGENTIC_POLICY.replace("{role}", "{" + AGENTIC_FIELD + "}")  # the policy, its role a field


def edit_samples(gate: str, n: int, seed: int = 0, flips: bool = True) -> list[tuple[Sample, str]]:
    """``n`` distinct held-out samples of ``gate`` without an erratum of their own, each with its policy's role;
    with ``flips``, only those whose decision the role flips (a red badge)."""
    out, seen = [], set()
    for sample in iter_samples(GATES[gate], seed, "heldout"):
        if (
            len(sample.turns) == 1
            and (sample.answer in ANSWER.values() or not flips)
            and sample.digest not in seen
        ):
            seen.add(sample.digest)
            out.append((sample, "admin" if "account_role: admin." in sample.system else "viewer"))
            if len(out) == n:
                break
    return out


def _session(handle: mmkv.ModelHandle, sample: Sample, role: str) -> mmkv.Session:
    """The sample's context with the policy's role as an editable field, prefilled."""
    session = mmkv.Session(handle, reuse="none")
    session.add_text(TEMPLATE, "system", {AGENTIC_FIELD: role})
    add_turns(session, sample)
    session.prefill()
    return session


def score_sample(
    handle: mmkv.ModelHandle, sample: Sample, role: str, gate: str, arms: Sequence[str], k: int
) -> list[dict]:
    """One record per arm: the decision after changing the role from ``role`` to the other one."""
    new = FLIP[role]
    results = {}
    for arm in ("full", *[a for a in arms if a != "full"]):
        session = _session(handle, sample, role)
        report = None
        if arm != "ignored":
            strategy = "selective" if arm.startswith("selective") else arm
            options = {"k": k, "rank": "deviation" if arm == "selective-deviation" else "attention"}
            report = session.edit(
                AGENTIC_FIELD, new, strategy, **(options if strategy == "selective" else {})
            )
        logits = session.next_token_logits(AGENTIC_QUESTION)
        answer = normalise_answer(session.ask(AGENTIC_QUESTION, max_new_tokens=8).text)
        results[arm] = (answer, logits, report, session.live.num_tokens)
    reference_answer, reference_logits = results["full"][0], results["full"][1]
    records = []
    for arm in arms:
        answer, logits, report, tokens = results[arm]
        records.append(
            {
                "arm": arm,
                "gate": gate,
                "sample": sample.digest[:16],
                "old": role,
                "new": new,
                "answer": answer,
                "correct": answer == ANSWER[new],
                "follows_old": answer == ANSWER[role],
                "agree": answer == reference_answer,
                "cosine": float(F.cosine_similarity(logits, reference_logits, dim=0)),
                "fraction": 0.0 if report is None else report.fraction,
                "edit_s": 0.0 if report is None else report.seconds,
                "recomputed": 0 if report is None else report.recomputed,
            }
        )
    return records


def aggregate(records: Sequence[dict], resamples: int = 1000, seed: int = 0) -> dict[str, dict[str, dict]]:
    """Per arm and gate (and ``"all"``): ``n``, then ``accuracy``, ``agreement``, ``follows_old`` (Wilson 95%),
    ``cosine`` (mean) and ``fraction``, ``edit_ms`` (medians; bootstrap 95%): ``EDIT_METRICS``. Pure."""
    return cells(records, "arm", "gate", EDIT_METRICS, resamples, seed, ARM_NAMES)


def run(
    model: str | mmkv.ModelHandle = "small-qwen3-vl",
    n: int = 200,
    seed: int = 0,
    k: int = 8,
    gates: Sequence[str] = ("text", "screen"),
    arms: Sequence[str] | None = None,
    device: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Score ``arms`` (``full`` always runs) on ``n`` samples per gate; write and return the results."""
    handle = model if isinstance(model, mmkv.ModelHandle) else mmkv.load(model, device=device)
    name = handle.name if isinstance(model, mmkv.ModelHandle) else str(model)
    unknown = set(arms or ()) - set(ARM_NAMES)
    if unknown:
        raise ValueError(f"unknown arms {sorted(unknown)}; choose from {ARM_NAMES}")
    bad_gates = set(gates) - set(GATES)
    if bad_gates:
        raise ValueError(f"unknown gates {sorted(bad_gates)}; choose from {sorted(GATES)}")
    arms = ARM_NAMES if arms is None else tuple(a for a in ARM_NAMES if a == "full" or a in arms)
    work = [(gate, sample, role) for gate in gates for sample, role in edit_samples(gate, n, seed)]
    out = Path(out) if out is not None else default_out("edit", name)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with torch.inference_mode():
        score_sample(handle, work[0][1], work[0][2], work[0][0], arms, k)  # warm-up, discarded
    records = []
    for gate, sample, role in tqdm(work, desc=f"edit {name}", unit="sample", disable=not progress):
        records.extend(score_sample(handle, sample, role, gate, arms, k))
    table = aggregate(records, seed=seed)
    results = {
        "settings": {
            "model": name,
            "family": handle.family.name,
            "device": str(handle.device),
            "dtype": str(handle.dtype),
            "n": n,
            "seed": seed,
            "k": k,
            "gates": list(gates),
            "arms": list(arms),
            "num_samples": len(work),
            "seconds": time.perf_counter() - started,
        },
        "records": records,
        "aggregate": table,
    }
    header = (
        f"# Edit eval: {name}\n\n{len(work)} distinct samples (red badge: the edit flips the call), strategies "
        f"against `full`, k = {k}; 95% intervals in brackets (Wilson for proportions, bootstrap for the rest).\n\n"
    )
    title = f"{name}: field edit, {len(work)} samples"
    write_results(out, results, header, edit_markdown(table), lambda p: edit_plot(table, p, title=title))
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="small-qwen3-vl")
    parser.add_argument("--n", type=int, default=200, help="samples per gate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=8, help="tokens recomputed after the field by selective")
    parser.add_argument("--gates", nargs="+", choices=sorted(GATES), default=["text", "screen"])
    parser.add_argument("--arms", nargs="+", choices=ARM_NAMES, default=None, help="full always runs")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="output folder (default runs/edit-<model>)")
    return parser


if __name__ == "__main__":
    script_main("evals/edit.py", build_parser(), run, edit_markdown)
