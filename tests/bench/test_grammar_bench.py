"""bench/grammar.py runs end to end on a tiny tokenizer: every arm timed, one table row per grammar."""

from __future__ import annotations

import pytest

import mmkv
from bench.grammar import MAKERS, bench, table

pytestmark = pytest.mark.bench


def test_grammar_bench_smoke():
    """Two rows (json_schema, tool_calls), each with positive per-token and one-off medians; the table has them."""
    handle = mmkv.load("tiny-qwen3-vl", device="cpu")
    rows = bench({"tiny": (handle.tokenizer, None)}, repeats=1)
    assert [row["grammar"] for row in rows] == list(MAKERS)
    for row in rows:
        assert row["tokens"] > 0 and row["vocab"] == len(handle.tokenizer)
        for key in (
            "argmax_us",
            "grammar_us",
            "mask_us",
            "ids_us",
            "vocabulary_ms",
            "spec_ms",
            "compile_ms",
            "start_ms",
        ):
            assert row[key]["median"] > 0, key
    assert table(rows).count("\n") == 3
