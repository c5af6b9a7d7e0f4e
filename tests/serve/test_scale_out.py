"""Two servers on one Redis: what one computed is a Redis hit in the other, with the same answer."""

from __future__ import annotations

import pytest

from mmkv.serve.process import running
from tests.redis_server import RedisServer
from tests.serve.conftest import RunningServer, image_part, user

pytestmark = pytest.mark.redis


def test_an_image_computed_by_one_server_is_a_redis_hit_in_the_other(tmp_path):
    """Server A computes a screenshot; server B (same Redis, its own memory) gets it from Redis and answers
    exactly as A did for the same conversation; B's metrics count the redis source."""
    with RedisServer() as redis_server:
        a, b = (RunningServer(["--model", "tiny-qwen3-vl", "--device", "cpu", "--store", redis_server.url],
                              tmp_path / f"{name}.log") for name in "ab")  # fmt: skip
        with running([a, b]):  # both load at once
            messages = [{"role": "system", "content": "You operate a desktop app."},
                        user(image_part(80), "What is on the screen?")]  # fmt: skip
            first = a.client().chat.completions.create(
                model="tiny-qwen3-vl", messages=messages, max_tokens=6, temperature=0
            )
            second = b.client().chat.completions.create(
                model="tiny-qwen3-vl", messages=messages, max_tokens=6, temperature=0
            )
            assert [i["source"] for i in first.model_extra["mmkv"]["images"]] == ["computed"]
            assert [i["source"] for i in second.model_extra["mmkv"]["images"]] == ["redis"]
            assert second.choices[0].message.content == first.choices[0].message.content
            assert 'mmkv_image_sources_total{tier="redis"} 1.0' in b.get("/metrics").text
