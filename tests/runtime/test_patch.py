"""``SegmentPatch`` (``mmkv.runtime.patch``): fitted on one context at full rank it reproduces that context's KV,
a low rank is small, applying it keeps the segment's identity, records round-trip and refuse tampering, the store
keeps patches beside KV."""

from __future__ import annotations

import pytest
import torch

import mmkv
from mmkv.cache.codec import CorruptEntryError
from mmkv.runtime.patch import PatchStore, decode_patch, encode_patch, fit_patch

TEXT = "Policy: approve red badges, escalate the rest. " * 2
CONTEXTS = [
    "Earlier notes about the archive and the library.\n\n",
    "A log of tool calls: search, open, read.\n\n" * 3,
]


@pytest.fixture(scope="module")
def compiled(tiny_by_name):
    """tiny-qwen3-vl, the text precompiled after its canonical preamble, and after each context."""
    handle = tiny_by_name["tiny-qwen3-vl"]
    opening = mmkv.text.canonical_preamble(handle, "system")
    stored = mmkv.text.precompile(handle, TEXT, role="system")
    seen = [mmkv.text.precompile(handle, TEXT, role="system", preamble=opening + c) for c in CONTEXTS]
    return handle, stored, seen


def test_a_full_rank_patch_of_one_context_reproduces_it(compiled):
    """Fitted on one context, whole: the patched segment moved there equals the KV computed there (1e-4), where the
    plain one is far off; keys stay in the segment's own frame (positions, digest and type unchanged)."""
    _, stored, seen = compiled
    patch = fit_patch(stored, seen[:1], rank=10**6)
    patched = patch.apply(stored)
    assert type(patched) is type(stored) and patched.digest == stored.digest
    assert torch.equal(patched.position_ids, stored.position_ids)
    moved = patched.moved_to(seen[0].start)
    assert (moved.keys - seen[0].keys).abs().max().item() <= 1e-4
    assert (moved.values - seen[0].values).abs().max().item() <= 1e-4
    assert (stored.moved_to(seen[0].start).keys - seen[0].keys).abs().max().item() > 1e-2


def test_a_low_rank_patch_is_small_and_moves_toward_the_contexts(compiled):
    """Rank 2 over two contexts: a tenth of the segment's bytes here, and the patched KV is closer to each context's
    than the plain one (mean over contexts)."""
    _, stored, seen = compiled
    patch = fit_patch(stored, seen, rank=2)
    assert patch.rank == 2 and patch.num_contexts == 2 and patch.nbytes * 8 < stored.nbytes
    patched = patch.apply(stored)

    def error(segment):
        return sum((segment.moved_to(s.start).values - s.values).norm().item() for s in seen)

    assert error(patched) < error(stored)


def test_a_patch_refuses_another_segment_and_bad_fits(compiled):
    """Another digest or length, other observed tokens, no observation, rank 0: ValueError naming the problem."""
    handle, stored, seen = compiled
    patch = fit_patch(stored, seen, rank=2)
    other = mmkv.text.precompile(handle, TEXT + "Then submit.", role="system")
    with pytest.raises(ValueError, match="this patch is for"):
        patch.apply(other)
    with pytest.raises(ValueError, match="other tokens"):
        fit_patch(stored, [other], rank=2)
    with pytest.raises(ValueError, match="at least one"):
        fit_patch(stored, [], rank=2)
    with pytest.raises(ValueError, match="rank"):
        fit_patch(stored, seen, rank=0)


def test_patch_records_round_trip_and_refuse_tampering(compiled, tmp_path):
    """Encoded and decoded: the same factors; a flipped payload byte, another model or digest: CorruptEntryError.
    A PatchStore on disk gives the patch back to a second store on the same directory."""
    handle, stored, seen = compiled
    patch = fit_patch(stored, seen, rank=3)
    data = encode_patch(patch, "model-a")
    back = decode_patch(data, "model-a", stored.digest)
    assert all(torch.equal(getattr(back, n), getattr(patch, n)) for n in ("key_left", "value_right"))
    tampered = bytearray(data)
    tampered[-3] ^= 0xFF
    for args in (
        (bytes(tampered), "model-a", stored.digest),
        (data, "model-b", stored.digest),
        (data, "model-a", "x"),
    ):
        with pytest.raises(CorruptEntryError):
            decode_patch(*args)
    PatchStore(tmp_path).put(stored.digest, patch, handle)
    again = PatchStore(tmp_path).get(stored.digest, handle)
    assert again is not None and torch.equal(again.key_left, patch.key_left)
    with pytest.raises(ValueError, match="digest"):
        PatchStore().put("another", patch, handle)
