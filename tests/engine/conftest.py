"""Requests for the engine's tests: conversations of tiny models laid out as a ``Session`` would, with images,
stores shared by the requests of one test, and the run of a list of requests through one ``EngineCore``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

import mmkv
from mmkv.cache import EncoderStore, KVStore
from mmkv.cache.memory import MemoryTier
from mmkv.engine import Done, EngineConfig, EngineCore, Failed, Request
from mmkv.runtime import DecodeOptions, LiveCache, TurnPolicy, TurnStores
from tests.conftest import random_image


@dataclass
class Stores:
    """One test's stores (every request of a run shares them, as the server's do)."""

    handle: mmkv.ModelHandle
    kv: KVStore = field(default_factory=KVStore)
    encoder: EncoderStore = field(default_factory=EncoderStore)
    vision_inputs: MemoryTier = field(default_factory=lambda: MemoryTier(64 << 20))

    def turn_stores(self, policy) -> TurnStores:
        return TurnStores(self.handle, self.kv, self.encoder, policy, self.vision_inputs)


@dataclass
class Outcome:
    """What one request heard."""

    events: list = field(default_factory=list)

    @property
    def answer(self):
        done = [e for e in self.events if isinstance(e, Done)]
        return done[0].answer if done else None

    @property
    def failed(self):
        failed = [e for e in self.events if isinstance(e, Failed)]
        return failed[0].error if failed else None


def conversation(handle: mmkv.ModelHandle, k: int, images: int = 1, window: int | None = None):
    """Conversation ``k``: a system prompt, ``images`` noise images (the first shared by every k, so it is
    spliced at another position in each), and a question whose length varies with ``k``."""
    session = mmkv.Session(handle, window=window)
    session.add_text("You look at screens." + " Carefully." * (k % 3), role="system")
    patch = handle.processor.image_processor.patch_size
    for i in range(images):
        session.add_text(f"Screen {i} of case {k}:")
        session.add_image(random_image(0 if i == 0 else 100 * k + i, (4, 4 + 2 * (k % 2)), patch))
    session.add_text("What changed?" + " Explain." * k)
    return session


def request_of(session: mmkv.Session, options: DecodeOptions, policy: TurnPolicy | None = None, **kwargs):
    """An engine ``Request`` for ``session``'s conversation as it stands, with a fresh live cache."""
    outcome = Outcome()
    request = Request(session.prompt_layout(None), session.images, policy or TurnPolicy(), options,
                      outcome.events.append, live=LiveCache(session.handle), **kwargs)  # fmt: skip
    return request, outcome


def run(stores: Stores, requests, config: EngineConfig, between=None) -> EngineCore:
    """Every request through one core until none is left; ``between(core)`` after each step."""
    core = EngineCore(stores.handle, config, stores.turn_stores)
    for request in requests:
        core.add(request)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 10_000, "the engine never finished"
        if between is not None:
            between(core)
    return core


@pytest.fixture
def stores(tiny) -> Stores:
    return Stores(tiny)


SERIAL = EngineConfig(max_batch=1, prefill_chunk=None, max_waiting=64)
BATCHED = EngineConfig(max_batch=8, prefill_chunk=None, max_waiting=64)
__all__ = ["BATCHED", "SERIAL", "Outcome", "Stores", "conversation", "request_of", "run"]
