"""Preambles for the compose eval (``evals/compose.py``) and its benchmark (``bench/compose.py``): text of varied
content and a requested token length that moves a precompiled segment away from where it was computed, in three
styles (notes of earlier steps, an archive of unrelated library notes, a log of tool calls), seeded.

    make_preamble(tokenizer, 256, seed=1, style="log")    # "Tool log.\ncall search(\"inbox\") -> 93 bytes, ..."
"""

from __future__ import annotations

import random

__all__ = ["STYLES", "calibration_texts", "make_preamble"]

STYLES = ("notes", "archive", "log")  # preamble texts
CALIBRATION_SEED = 104_729  # calibration texts draw from seeds far from any eval seed's
_PAGES = ("settings", "billing", "inbox", "reports", "profile", "search results", "audit log", "dashboard")
_ACTS = ("opened", "scrolled", "closed", "refreshed", "filtered", "exported", "reviewed", "bookmarked")
_ARCHIVE = (
    "The reading room extended its opening hours for the {n}th winter season.",
    "Volunteers catalogued {n} donated atlases and sorted the periodicals by year.",
    "A lecture on the history of coastal lighthouses is planned for room {n}.",
    "The heating in the east wing was repaired after the storm; {n} radiators were replaced.",
    "Visitors returned {n} borrowed umbrellas to the stand by the door.",
    "The map collection moved to shelf {n} after the flood in the basement.",
)
_TOOLS = ("open_file", "search", "read_page", "list_dir", "run_query", "fetch_url")


def make_preamble(tokenizer, tokens: int, seed: int, style: str = "notes") -> str:
    """A preamble of ``style`` (``STYLES``: notes of a previous session, an archive of unrelated library notes,
    a log of tool calls and results; seeded), at least ``tokens`` tokens long as ``tokenizer`` counts them, ending
    with a blank line. ``tokens`` 0 gives ``""``."""
    if style not in STYLES:
        raise ValueError(f"unknown preamble style {style!r}; choose from {STYLES}")
    if tokens <= 0:
        return ""
    rng = random.Random(seed)
    lines = [{"notes": "Notes from earlier steps.", "archive": "Archive notes.", "log": "Tool log."}[style]]
    while len(tokenizer("\n".join(lines))["input_ids"]) < tokens:
        if style == "notes":
            lines.append(
                f"Step {len(lines)}: {rng.choice(_ACTS)} the {rng.choice(_PAGES)} page; {rng.randint(0, 99)} items, "
                f"{rng.choice(('none', 'one', 'two'))} flagged, id {rng.randint(1000, 9999)}."
            )
        elif style == "archive":
            lines.append(rng.choice(_ARCHIVE).format(n=rng.randint(2, 99)))
        else:
            lines.append(
                f'call {rng.choice(_TOOLS)}("{rng.choice(_PAGES)}") -> {rng.randint(0, 500)} bytes, '
                f"status {rng.choice(('ok', 'ok', 'empty', 'retry'))}"
            )
    return "\n".join(lines) + "\n\n"


def calibration_texts(tokenizer, style: str, lengths=(256, 1024), seed: int = 0) -> list[str]:
    """Preambles of every style but ``style`` at ``lengths`` tokens, from seeds no eval preamble uses: the contexts a
    segment patch is fitted on before it is tested after a ``style`` preamble (``evals/compose.py``)."""
    others = [s for s in STYLES if s != style]
    return [make_preamble(tokenizer, n, CALIBRATION_SEED + seed + 31 * i, s) for i, (s, n) in enumerate(
        (s, n) for s in others for n in lengths)]  # fmt: skip
