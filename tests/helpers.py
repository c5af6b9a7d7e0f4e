"""Helpers the test modules share (one place, so that no test module imports another): synthetic prompt
layouts and a fake store for the planner, the model's own forward over a session's rendering, random bounded
JSON schemas and tools, the grammar surface's limit-breaking schemas, a strict JSON reader, and the diskcache
index rows the store-fault tests rewrite. Fixtures stay in the ``conftest.py`` files."""

from __future__ import annotations

import itertools
import json
import random
import sqlite3
import time
from pathlib import Path

import torch
from PIL import Image

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.kv.segment import KVSegment
from mmkv.messages import ConversationImage
from mmkv.mrope import RotaryLayout
from mmkv.prompt.layout import PromptLayout, PromptPiece, SegmentAnchor
from mmkv.runtime import LiveCache, PrefillStats, TurnPolicy, TurnStores, run_turn
from mmkv.runtime.json_schemas import MAX_SCHEMA_DEPTH

# ---- synthetic layouts and stores for the planner (no model) ----

TEXT, START, PAD, END = 7, 1, 2, 3  # synthetic ids: any text, <|vision_start|>, <|image_pad|>, <|vision_end|>


ROTARY = RotaryLayout("sectioned", (1, 1, 2), torch.ones(4))


def synthetic_segment(ids: list[int], digest: str = "") -> KVSegment:
    """Zero KV over synthetic ``ids`` (an image segment when they hold a pad), in the 2-layer toy layout."""
    n = len(ids)
    return KVSegment(
        torch.zeros(2, 1, 1, n, 8), torch.zeros(2, 1, 1, n, 8), torch.tensor(ids), torch.zeros(3, n, dtype=torch.long),
        "image" if PAD in ids else "text", digest, ROTARY,
    )  # fmt: skip


def synthetic_image(digest: str) -> ConversationImage:
    """A 4x4 picture known only by ``digest``, with a (1, 4, 4) grid."""
    return ConversationImage(Image.new("RGB", (4, 4)), digest, (1, 4, 4))


def synthetic_layout(spec: list, segments: tuple[SegmentAnchor, ...] = ()) -> PromptLayout:
    """``spec``: ``("text", n)`` runs and ``("image", num_pads, conversation image index)`` pieces."""
    ids, pieces, order, cursor = [], [], [], 0
    for entry in spec:
        if entry[0] == "text":
            piece_ids = [TEXT] * entry[1]
            pieces.append(PromptPiece("text", cursor, len(piece_ids)))
        else:
            piece_ids = [START] + [PAD] * entry[1] + [END]
            pieces.append(PromptPiece("image", cursor, len(piece_ids), len(order), (1, 4, 4)))
            order.append(entry[2])
        ids += piece_ids
        cursor += len(piece_ids)
    positions = torch.arange(cursor).expand(3, -1).clone()
    return PromptLayout(torch.tensor(ids), positions, tuple(pieces), tuple(order), None, None, segments)


class FakeStores:
    """Store answers by digest: KV segments with their tier, encoder tiers (default "computed")."""

    def __init__(self, kv=None, encoder=None):
        self.kv_hits = kv or {}
        self.encoder = encoder or {}
        self.asked: list[str] = []

    def kv(self, image):
        self.asked.append(image.digest)
        return self.kv_hits.get(image.digest, (None, None))

    def encoder_tier(self, image):
        return self.encoder.get(image.digest, "computed")


IMAGES = [synthetic_image("a"), synthetic_image("b"), synthetic_image("c")]


IMAGE_IDS = [START, PAD, PAD, PAD, PAD, END]  # a 4-pad image span


# ---- the model's own computation ----


def full_forward_logits(handle, session: mmkv.Session, question: str) -> torch.Tensor:
    """The model's own forward (pixels, get_rope_index) over the processor's rendering of the conversation and
    ``question``: the last token's ``(vocab,)`` float logits. Changes no state of the shared model."""
    messages = [dict(m, content=list(m["content"])) for m in session.messages]
    if messages and messages[-1]["role"] == "user":  # the session joins the question to the user's message
        messages[-1]["content"].append({"type": "text", "text": question})
    else:
        messages.append({"role": "user", "content": [{"type": "text", "text": question}]})
    proc = handle.processor
    images = [
        session.images[item["image_index"]].pixels
        for m in messages
        for item in m["content"]
        if item["type"] == "image"
    ]
    inputs = proc(proc.apply_chat_template(messages), images or None)
    grids = {"image_grid_thw": inputs["image_grid_thw"]} if images else {}
    positions, _ = handle.model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], **grids
    )  # (3, 1, L), the model's own; passed in, so the shared model keeps no rope_deltas
    with torch.inference_mode():
        out = handle.model(**inputs, position_ids=positions)
    return out.logits[0, -1].float()


def held_prompt(
    handle: mmkv.ModelHandle,
    session: mmkv.Session,
    question: str,
    policy: TurnPolicy | None = None,
    stores: tuple[KVStore, EncoderStore] | None = None,
) -> tuple[PromptLayout, LiveCache, torch.Tensor, PrefillStats]:
    """A fresh ``LiveCache`` brought up to ``session``'s prompt for ``question`` by ``run_turn`` (under
    ``policy``, default full recompute, with ``stores`` or fresh ones): the layout, the cache, the last token's
    logits and the stats. Changes neither the session nor the model."""
    policy = TurnPolicy(reuse="none") if policy is None else policy
    kv_store, encoder_store = (KVStore(), EncoderStore()) if stores is None else stores
    layout, live = session.prompt_layout(question), LiveCache(handle)
    with torch.inference_mode():
        logits, stats = run_turn(
            handle, live, layout, session.conversation.images,
            TurnStores(handle, kv_store, encoder_store, policy), policy,
        )  # fmt: skip
    return layout, live, logits, stats


# ---- random bounded schemas and tools ----


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded schema: integers with min/max, strings with maxLength, booleans, enums, arrays with maxItems,
    objects with required fields and no additional properties, nested up to depth 2."""
    kinds = ["integer", "string", "boolean", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)} | (
            {"minLength": 1} if rng.random() < 0.3 else {}
        )
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "a b", 'q"uote', 7, -3, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-4 random properties, some required, half with additionalProperties: false."""
    names = rng.sample(["name", "count", "ok", "items", "where", "kind", "x"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    closed = {"additionalProperties": False} if rng.random() < 0.5 else {}  # (closed by the grammar anyway)
    return {"type": "object", "properties": properties, "required": required} | closed


def random_tools(rng: random.Random) -> list[dict]:
    """1-4 function tools with distinct names and random object parameters."""
    names = rng.sample(["click", "type_text", "scroll", "open-url", "wait", "drag"], rng.randint(1, 4))
    return [
        {"type": "function", "function": {"name": name, "parameters": random_object(rng)}} for name in names
    ]


# ---- schemas past the grammar surface's limits ----

_unique = itertools.count()


def fresh(schema: dict) -> dict:
    """``schema`` with a description no other test's schema has: neither its checks nor its grammar are
    cached yet."""
    return {**schema, "description": f"fresh {next(_unique)} {time.monotonic_ns()}"}


def nested_any_of(depth: int) -> dict:
    """``depth`` levels of anyOf, each an integer or the level below (2 * depth objects and arrays deep)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "string", "maxLength": 2}, schema]}
    return schema


# every form is an object schema, so that it is a tool's parameters as it stands
LIMITS = {
    "recursive $defs": {"type": "object", "$defs": {"node": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}, "$ref": "#/$defs/node"},
    "$ref to the root": {"type": "object", "$ref": "#"},
    "two-definition loop": {"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                            "$ref": "#/$defs/a"},
    "5,000 optional properties": {"type": "object",
                                  "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}},
    "800 optional properties": {"type": "object",
                                "properties": {f"p{i}": {"type": "integer"} for i in range(800)}},
    "deeply nested anyOf": {"type": "object", "properties": {"v": nested_any_of(MAX_SCHEMA_DEPTH)}},
}  # fmt: skip


def strict_loads(text: str):
    """``json.loads`` that refuses an object with a key twice (as a strict parser does)."""

    def unique(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) < len(keys):
            raise ValueError(f"duplicate key in {keys}")
        return dict(pairs)

    return json.loads(text, object_pairs_hook=unique)


# ---- the disk tier's index ----

BIG = 200_000  # bytes: over diskcache's 32 KiB threshold, so the value lives in a file


def sqlite_rows(path: Path) -> list[tuple[str, str | None]]:
    """The (key, filename) rows of the diskcache index under ``path``."""
    with sqlite3.connect(path / "cache.db") as db:
        return db.execute("SELECT key, filename FROM Cache").fetchall()


def point_row_at(path: Path, key: str, filename: str) -> None:
    """Rewrite the index under ``path`` so that ``key``'s row names ``filename`` (a hostile index)."""
    with sqlite3.connect(path / "cache.db") as db:
        db.execute("UPDATE Cache SET filename = ? WHERE key = ?", (filename, key))


def metric_value(metrics, name: str, **labels: str) -> float:
    """The value of sample ``name`` (as ``/metrics`` writes it: ``mmkv_prompt_tokens_total``,
    ``mmkv_queue_wait_seconds_count``, ...) in a server's ``Metrics`` registry; 0 for a sample not yet written
    (a label never counted)."""
    return metrics.registry.get_sample_value(name, labels or None) or 0.0
