"""Constrained decoding's cost: per token, the grammar's mask and advance against unconstrained argmax over the
same random logits; per request, making a spec, compiling it and starting an answer.

Run::

    python bench/grammar.py                          # the small checkpoints' tokenizer (700 tokens)
    python bench/grammar.py --qwen-size --json grammar.json
        # also a byte-level BPE trained here on Python sources to Qwen's 151,643 tokens (about 25 s), masks sized
        # to Qwen3-VL's 151,936 embedding rows: the vocabulary size that sets the mask's cost in production

Per tokenizer and grammar (a bounded JSON schema; a `required` choice among four tools), prints tokens per
answer and the median per-token cost [min-max] of four arms over the same seeded random logits, interleaved
A B C D A B C D in one process: ``argmax`` alone (unconstrained), ``grammar`` (the constraint's own work:
``allowed_ids()`` and ``advance`` replaying the answer), ``mask`` (``allowed()``, -inf elsewhere, argmax,
``advance``) and ``ids`` (``allowed_ids()``, argmax among them, ``advance``). Then the one-off costs: the
vocabulary (built once per tokenizer), a spec (validation, cold), compile + first mask (cold) and start + first
mask (compiled grammar cached).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repository root importable (for bench.timing)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.timing import Timing, interleave
from mmkv.runtime.grammar import (
    GrammarSpec,
    Vocabulary,
    build_grammar,
    clear_caches,
    compile_grammar,
    constraint_for,
    json_schema,
    tool_calls,
    vocabulary,
)

QWEN_TOKENIZER_SIZE = 151_643  # ordinary tokens of the released Qwen2.5 / Qwen3 tokenizers
QWEN3_VL_VOCAB = 151_936  # Qwen3-VL-8B embedding rows

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 1920}, "y": {"type": "integer", "minimum": 0, "maximum": 1080}},
    "required": ["x", "y"],
    "additionalProperties": False,
}  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"enum": ["click", "type", "scroll", "done"]},
        "target": POINT,
        "text": {"type": "string", "maxLength": 24},
        "checks": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
    },
    "required": ["action", "target", "text", "checks"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "click", "parameters": {"type": "object", "properties": {"at": POINT}, "required": ["at"]}}},
    {"type": "function", "function": {"name": "type_text", "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 24}}, "required": ["text"]}}},
    {"type": "function", "function": {"name": "scroll", "parameters": {"type": "object", "properties": {"dy": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["dy"]}}},
    {"type": "function", "function": {"name": "done", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip


MAKERS = {
    "json_schema": lambda: json_schema(SCHEMA, strict=True),  # a bounded JSON schema
    "tool_calls": lambda: tool_calls(TOOLS, "required"),  # a `required` choice among four tools
}


def qwen_sized_tokenizer(corpus_chars: int = 60_000_000):
    """A byte-level BPE trained on this machine's Python sources to the Qwen vocabulary size (its merges are not
    Qwen's; its size, which sets the mask's cost, is)."""
    from mmkv.model.tiny import train_tokenizer

    texts, size = [], 0
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]  # the stdlib, site-packages
    for path in (p for root in roots for p in sorted(Path(root).rglob("*.py"))):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        size += len(texts[-1])
        if size >= corpus_chars:
            break
    return train_tokenizer(texts, QWEN_TOKENIZER_SIZE)


def per_token_us(
    vocab: Vocabulary, spec: GrammarSpec, repeats: int, device: str, max_tokens: int = 256
) -> dict:
    """Per-token cost of a greedy step, interleaved, over the same precomputed random logits: ``argmax`` alone
    (unconstrained), ``grammar`` (the constraint's own work: allowed_ids() and advance() replaying the answer),
    ``mask`` (allowed(), fill the rest with -inf, argmax, advance) and ``ids`` (allowed_ids(), argmax among
    them, advance). Each repeat starts a new answer from the cached compiled grammar."""
    compiled = compile_grammar(vocab, spec)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(max_tokens, vocab.vocab_size, generator=generator).to(device)  # (T, vocab)
    lengths: list[int] = []

    def by_mask() -> int:
        constraint, step = compiled.start(), 0
        while not constraint.is_finished() and step < max_tokens:
            mask = constraint.allowed().to(device)  # (vocab,)
            constraint.advance(int(logits[step].masked_fill(~mask, float("-inf")).argmax()))
            step += 1
        return step

    def by_ids() -> int:
        constraint, step = compiled.start(), 0
        while not constraint.is_finished() and step < max_tokens:
            ids = constraint.allowed_ids()  # (num_allowed,)
            constraint.advance(int(ids[int(logits[step][ids.to(device)].argmax())]))
            step += 1
        return step

    answer: list[int] = []  # the greedy answer's tokens, replayed by the "grammar" arm

    def grammar_only() -> int:
        if not answer:
            constraint, step = compiled.start(), 0
            while not constraint.is_finished() and step < max_tokens:
                answer.append(int(logits[step].masked_fill(~constraint.allowed(), float("-inf")).argmax()))
                constraint.advance(answer[-1])
                step += 1
        constraint = compiled.start()
        for token in answer:
            constraint.allowed_ids()
            constraint.advance(token)
        return len(answer)

    def unconstrained() -> int:
        for step in range(max_tokens):
            int(logits[step].argmax())
        return max_tokens

    def measure(name: str, fn) -> float:
        started = time.perf_counter()
        steps = fn()  # int() of each chosen token synchronises the device
        elapsed_ms = 1e3 * (time.perf_counter() - started)
        if name == "mask":
            lengths.append(steps)
        return 1e3 * elapsed_ms / steps  # microseconds per token, in Timing's millisecond slot

    arms = {"argmax": unconstrained, "grammar": grammar_only, "mask": by_mask, "ids": by_ids}
    timings = interleave(arms, repeats, measure=measure)
    return {"tokens": max(lengths), **timings}


def one_off_ms(tokenizer, vocab_size: int | None, spec_name: str, repeats: int) -> dict[str, Timing]:
    """Costs paid once, interleaved: the vocabulary (once per tokenizer), a spec's validation (cold), compile +
    first mask (cold), start + first mask (the compiled grammar cached, as on every later request)."""
    make = MAKERS[spec_name]
    spec = make()
    vocab = vocabulary(tokenizer, vocab_size)
    compiled = compile_grammar(vocab, spec)
    built: list[Vocabulary] = []

    def build_vocabulary():
        built[:] = [vocabulary.__wrapped__(tokenizer, vocab_size)]  # uncached (frees the previous one too)

    def spec_cold():
        clear_caches()  # the other arms hold their own vocabulary and compiled grammar
        make()

    arms = {
        "vocabulary": build_vocabulary,
        "spec": spec_cold,
        "compile": lambda: build_grammar(vocab, spec).start().allowed(),
        "start": lambda: compiled.start().allowed(),
    }
    return interleave(arms, repeats)


def bench(tokenizers: dict[str, tuple], repeats: int, device: str = "cpu") -> list[dict]:
    """One row per (tokenizer, grammar): per-token arms and one-off costs."""
    rows = []
    for label, (tokenizer, vocab_size) in tokenizers.items():
        for spec_name, make in MAKERS.items():
            vocab, spec = vocabulary(tokenizer, vocab_size), make()
            tokens = per_token_us(vocab, spec, repeats, device)
            once = one_off_ms(tokenizer, vocab_size, spec_name, max(3, repeats // 4))
            rows.append(
                {
                    "tokenizer": label,
                    "vocab": vocab.vocab_size,
                    "grammar": spec_name,
                    "tokens": tokens["tokens"],
                    "device": device,
                    **{f"{arm}_us": tokens[arm].as_dict() for arm in ("argmax", "grammar", "mask", "ids")},
                    **{f"{name}_ms": timing.as_dict() for name, timing in once.items()},
                }
            )
    return rows


def decode_loop_ms(handle, repeats: int, tokens: int = 40) -> dict[str, Timing]:
    """ms per generated token of the whole decode loop (model forward, sampling, text, and the constraint) on
    ``handle``, free against constrained, interleaved over the same prompt: the cost an answer pays."""
    import mmkv
    from mmkv.runtime import DecodeOptions, Decoder

    session = mmkv.Session(handle, reuse="none")
    session.add_text("Answer with one JSON object.", "system")
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        "target": {"type": "string", "enum": ["approve", "submit", "close"]}}, "required": ["target"]}}}
        for n in ("click", "escalate")]  # fmt: skip
    grammars = {
        "free": None,
        "json_schema": MAKERS["json_schema"](),
        "tool_calls": tool_calls(tools, "required"),
    }

    def arm(spec):
        def run() -> float:
            with torch.inference_mode():
                logits = session.next_token_logits("What now?")
                live = session.live.copy_prefix(session.live.num_tokens)
                constraint = None if spec is None else constraint_for(handle, spec)
                decoder = Decoder(handle, live, logits, DecodeOptions(tokens), constraint=constraint)
                started = time.perf_counter()
                count = sum(1 for _ in decoder)
                return 1e3 * (time.perf_counter() - started) / count

        return run

    arms = {name: arm(spec) for name, spec in grammars.items()}
    return interleave(arms, repeats, measure=lambda name, fn: fn())  # each arm reports its ms per token


def _cell(d: dict, digits: int = 1) -> str:
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows: per-token medians [min-max] in microseconds, one-off costs in ms."""
    head = (
        "| tokenizer | vocab | grammar | tokens | argmax us/token | grammar us/token | mask us/token | ids us/token "
        "| vocabulary ms | spec ms | compile + 1st mask ms | start + 1st mask ms |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['tokenizer']} | {r['vocab']} | {r['grammar']} | {r['tokens']} | {_cell(r['argmax_us'])} "
            f"| {_cell(r['grammar_us'])} | {_cell(r['mask_us'])} | {_cell(r['ids_us'])} | {_cell(r['vocabulary_ms'], 1)} "
            f"| {_cell(r['spec_ms'], 1)} | {_cell(r['compile_ms'], 1)} | {_cell(r['start_ms'], 2)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("bench/grammar.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small-qwen3-vl", help="whose tokenizer (any mmkv.load name)")
    parser.add_argument("--qwen-size", action="store_true", help="also a tokenizer of Qwen's vocabulary size")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--device", default="cpu", help="where the logits live (the masks are made on the CPU)"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import mmkv

    handle = mmkv.load(args.model, device="cpu")
    tokenizers = {args.model: (handle.tokenizer, int(handle.text_config.vocab_size))}
    if args.qwen_size:
        started = time.perf_counter()
        tokenizers["bpe-151k (trained here)"] = (qwen_sized_tokenizer(), QWEN3_VL_VOCAB)
        print(f"trained the Qwen-sized tokenizer in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    rows = bench(tokenizers, args.repeats, args.device)
    print(table(rows))
    loop = decode_loop_ms(handle, max(3, args.repeats // 4))
    print(f"\nthe whole decode loop on {args.model}, ms per generated token, median [min-max]: "
          + ", ".join(f"{name} {_cell(t.as_dict(), 2)}" for name, t in loop.items()))  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "decode_loop_ms": {k: t.as_dict() for k, t in loop.items()}}, indent=2)
        )
