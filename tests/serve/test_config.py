"""ServerConfig: every bound refused when it is not a valid number of its kind (the class of fault, for every
field), the engine's settings and the served names read off it."""

from __future__ import annotations

import dataclasses

import pytest

from mmkv.engine import EngineConfig
from mmkv.runtime import TurnPolicy
from mmkv.serve.config import ServerConfig

ZERO_ALLOWED = {"max_queue", "pool_bytes", "port"}
SECONDS = [f.name for f in dataclasses.fields(ServerConfig) if f.name.endswith("_s")]
COUNTS = [f.name for f in dataclasses.fields(ServerConfig) if f.type == "int" and f.name != "prefill_chunk"]


def test_the_field_lists_are_the_ones_the_config_declares():
    assert {"request_timeout_s", "header_timeout_s", "drain_timeout_s"} <= set(SECONDS) and len(SECONDS) == 6
    assert {"max_batch", "max_images", "decode_budget_bytes", "port"} <= set(COUNTS) and len(COUNTS) == 19


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("bad", [-1, 0, True, 2.0, "8", None])
def test_every_count_refuses_what_is_not_an_int_in_range_naming_the_field(name, bad):
    if bad == 0 and not isinstance(bad, bool) and name in ZERO_ALLOWED:
        assert getattr(ServerConfig("m", **{name: 0}), name) == 0
        return
    with pytest.raises(
        ValueError, match=rf"^{name} must be an int >= {0 if name in ZERO_ALLOWED else 1}, got"
    ):
        ServerConfig("m", **{name: bad})


@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize("bad", [0, -0.5, True, float("nan"), "10", None])
def test_every_duration_refuses_what_is_not_a_positive_number_naming_the_field(name, bad):
    with pytest.raises(ValueError, match=rf"^{name} must be a positive number of seconds, got"):
        ServerConfig("m", **{name: bad})


@pytest.mark.parametrize(
    "changes, error, message",
    [({"model": ""}, ValueError, "model must be a non-empty name"), ({"model": None}, ValueError, "model must"),
     ({"prefill_chunk": 15}, ValueError, "prefill_chunk must be an int >= 16"),
     ({"policy": "kv"}, TypeError, "policy must be an mmkv.runtime.TurnPolicy, got str")],
)  # fmt: skip
def test_the_other_fields_are_refused_with_their_names(changes, error, message):
    with pytest.raises(error, match=message):
        ServerConfig(**({"model": "m"} | changes))


def test_the_engine_settings_and_the_served_names_come_from_the_config():
    config = ServerConfig("small", served_names=("alias", "small", "other"), max_batch=3, max_batch_kv_bytes=99,
                          prefill_chunk=64, max_queue=0, policy=TurnPolicy(reuse="encoder"))  # fmt: skip
    assert config.engine == EngineConfig(3, 99, 64, 0)
    assert config.names == ("small", "alias", "other")
