"""The server's ``Engine``: image records kept by their bytes (a resent screenshot is neither decoded nor hashed
again; the detail it was read at is part of the key), the decode budget given back after every decode, failed
ones included, a finished answer counted in the metrics exactly once per token and image, and every refusal's
exception mapped to its HTTP status by type."""

from __future__ import annotations

import io

import pytest
from PIL import Image

import mmkv
import mmkv.serve.engine as engine_module
from mmkv.errors import GrammarTimeoutError, ImageError, ImageTooLargeError, ModelNotFoundError
from mmkv.runtime import Answer, ImageReuse
from mmkv.runtime.report import PrefillStats
from mmkv.serve.config import ServerConfig
from mmkv.serve.engine import Engine, as_api_error
from mmkv.serve.intake import LOW_DETAIL_SIDE
from mmkv.serve.media import MediaError
from mmkv.serve.protocol import ApiError, BadRequest, Busy, Timeout, TooLarge
from tests.conftest import random_image
from tests.helpers import metric_value


@pytest.fixture(scope="module")
def engine():
    engine = Engine(ServerConfig(model="tiny-qwen3-vl", device="cpu"))
    yield engine
    engine.close()


def _png(seed: int, size=(64, 96)) -> bytes:
    buffer = io.BytesIO()
    random_image(seed, (size[0] // 16, size[1] // 16), 16).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_resent_image_is_decoded_once_per_detail(engine, monkeypatch):
    """The same bytes give the same record without a second decode; the same bytes at ``detail: low`` are
    another record (decoded once too); other bytes are decoded."""
    calls = []
    real = engine_module.prepare_image
    monkeypatch.setattr(engine_module, "prepare_image", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    data = _png(1)
    first = engine._image(data)
    assert engine._image(data) is first and engine._image(bytes(data), "auto") is first
    assert len(calls) == 1
    low = engine._image(data, "low")
    assert low is not first and engine._image(data, "low") is low and len(calls) == 2
    assert engine._image(_png(2)) is not first and len(calls) == 3
    assert engine.decoding.in_use == 0


def test_low_detail_fits_the_square_and_keeps_the_aspect(engine):
    """A picture larger than the low-detail square is shrunk to fit it, aspect kept; a smaller one is kept."""
    buffer = io.BytesIO()
    Image.new("RGB", (1600, 800), (10, 20, 30)).save(buffer, "PNG")
    record = engine._image(buffer.getvalue(), "low")
    original = engine._image(buffer.getvalue())
    assert max(record.pixels.size) <= LOW_DETAIL_SIDE < max(original.pixels.size)
    assert abs(record.pixels.width / record.pixels.height - 2.0) < 0.2
    small = _png(3)
    assert engine._image(small, "low").pixels.size == engine._image(small).pixels.size


@pytest.mark.parametrize(
    "data", [b"", b"not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 64], ids=["empty", "text", "cut png"]
)
def test_a_failed_decode_gives_the_budget_back_and_keeps_no_record(engine, data):
    """An undecodable image raises ``ImageError``, holds none of the decode budget afterwards, and
    leaves no record behind (the next try decodes again and fails again)."""
    before = len(engine.decoded)
    for _ in range(2):
        with pytest.raises(ImageError):
            engine._image(data)
    assert engine.decoding.in_use == 0 and len(engine.decoded) == before


def test_a_finished_answer_is_counted_once_per_token_and_image(engine):
    """``count_answer`` adds the answer's prompt, reused, prefilled and generated tokens and one count per image
    under the tier its KV came from; the time to first token is one observation."""
    m = engine.metrics
    names = ("prompt_tokens", "cached_tokens", "prefilled_tokens", "completion_tokens", "ttft_seconds_count")
    samples = [f"mmkv_{n}" if n.endswith("_count") else f"mmkv_{n}_total" for n in names]
    before = [metric_value(m, s) for s in samples]
    tiers = {t: metric_value(m, "mmkv_image_sources_total", tier=t) for t in ("memory", "computed", "live")}
    images = (ImageReuse(0, "a", "memory"), ImageReuse(1, "b", "computed"), ImageReuse(2, "c", "memory"))
    answer = Answer("hi", (5, 6, 7), "stop", 0.25, 0.5, PrefillStats(40, 10, 30, images))
    engine.count_answer(answer)
    after = [metric_value(m, s) for s in samples]
    assert [a - b for a, b in zip(after, before, strict=True)] == [40, 30, 10, 3, 1]
    assert {t: metric_value(m, "mmkv_image_sources_total", tier=t) - v for t, v in tiers.items()} == {
        "memory": 2, "computed": 1, "live": 0}  # fmt: skip

REFUSALS = [
    (TimeoutError(), Timeout, 504, "the request timed out"),
    (TimeoutError("slow"), Timeout, 504, "slow"),
    (GrammarTimeoutError("the grammar waited"), Timeout, 504, "the grammar waited"),
    (MediaError("too big", 413), TooLarge, 413, "too big"),
    (MediaError("too slow", 504), Timeout, 504, "too slow"),
    (MediaError("not allowed", 403), BadRequest, 400, "not allowed"),
    (MediaError("bad url"), BadRequest, 400, "bad url"),
    (ImageTooLargeError("many pixels"), TooLarge, 413, "many pixels"),
    (ImageError("not a picture"), BadRequest, 400, "not a picture"),
    (ModelNotFoundError("gone"), BadRequest, 400, "gone"),
    (ValueError("a field"), BadRequest, 400, "a field"),
    (TypeError("a type"), BadRequest, 400, "a type"),
]


@pytest.mark.parametrize(
    ("error", "kind", "status", "message"), REFUSALS, ids=lambda v: getattr(v, "__name__", None)
)
def test_every_refusal_maps_to_its_status_by_type(error, kind, status, message):
    refusal = as_api_error(error, "messages")
    assert type(refusal) is kind and refusal.status == status
    assert refusal.message == message and refusal.param == "messages"


def test_an_api_error_is_its_own_refusal_and_anything_else_is_not_one():
    """An ``ApiError`` passes through unchanged (its own param kept); an exception that stands for no refusal
    (a bug) is a ``TypeError``, never a 400 that would hide it."""
    busy = Busy("full", "queue")
    assert as_api_error(busy, "messages") is busy and busy.param == "queue"
    assert isinstance(busy, ApiError)
    for bug in (KeyError("k"), RuntimeError("r"), AssertionError(), ZeroDivisionError()):
        with pytest.raises(TypeError, match=f"not a refusal: {type(bug).__name__}"):
            as_api_error(bug)


def test_stores_put_vision_outputs_beside_the_kv_of_each_directory(tmp_path):
    """A directory tier holds image KV and, in its ``encoder`` subdirectory, vision outputs; the memory tiers
    take the bounds given."""
    kv, encoder = engine_module._stores((str(tmp_path),), 1 << 20, 1 << 19)
    assert kv._memory.max_bytes == 1 << 20 and encoder._memory.max_bytes == 1 << 19
    assert kv.path == tmp_path and encoder.path == tmp_path / "encoder"


def test_an_unknown_model_is_refused_at_construction():
    with pytest.raises(mmkv.MmkvError):
        Engine(ServerConfig(model="no-such-model-anywhere", device="cpu"))
