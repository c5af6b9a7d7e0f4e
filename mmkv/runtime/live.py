"""``LiveCache``: the KV a session (or a server's pool entry) holds right now, with what it holds it for.

A transformers ``DynamicCache`` plus, for every cache entry, its token id and ``(3,)`` M-RoPE position, and the
pieces (text runs, images) the entries came from. Entry ``i`` of the cache is prompt token ``i``: the live
cache always holds a prefix of the last prompt it was brought up to (plus decoded tokens). Example::

    live = LiveCache(handle)
    keep = live.matching_prefix(layout)    # 0 on a cold cache; reads only
    cut = live.truncate(keep, collect_text=True)   # text pieces after `keep`, as segments, then cropped
    ...                                     # execute(plan) appends the new prompt and marks it held
    live.num_tokens                         # == layout.num_tokens afterwards

Only the methods below change it (no other code touches its ``DynamicCache``); each says what it changes:
``reset``, ``truncate`` (crop), ``append_spliced`` + ``forward`` + ``reorder_tail`` + ``mark_prompt`` (a plan
being executed), ``extend`` (a decoded token), ``probe`` (a query that leaves the cache as it was).
``copy_prefix`` and ``segment`` read only.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from transformers import DynamicCache

from ..compat import crop_cache
from ..kv.prefill import PrefillResult, new_cache, prefill_span
from ..kv.segment import KVSegment, SegmentKind, append_to_cache, reorder_cache, segment_from_cache
from ..kv.vision import ImageFeatures
from ..model.handle import ModelHandle
from ..prompt.layout import PromptLayout, PromptPiece

__all__ = ["LiveCache"]


class LiveCache:
    """One live ``DynamicCache`` and the ids, positions and pieces of its entries. Not thread-safe."""

    def __init__(self, handle: ModelHandle) -> None:
        self.handle = handle
        self.reset()

    def reset(self) -> None:
        """Empty it (a fresh ``DynamicCache``)."""
        self.cache: DynamicCache = new_cache(self.handle)
        self.token_ids = torch.zeros(0, dtype=torch.long)  # (N,) id of every entry
        self.positions = torch.zeros(3, 0, dtype=torch.long)  # (3, N) position of every entry
        self.pieces: tuple[PromptPiece, ...] = ()  # pieces of the held prompt, in order
        self.image_digests: dict[int, str] = {}  # first entry of each held image -> its content digest
        self.prompt_tokens = 0  # entries of the last prompt recorded (the rest: decoded tokens)
        self.forward_seconds = 0.0  # time spent in the model's forward building this cache (a running total)

    @contextlib.contextmanager
    def dropped_on_error(self) -> Iterator[None]:
        """A guard for work on this cache: on any exception inside the block the cache is reset (emptied), so a
        failed turn never leaves half-built KV behind; the exception propagates."""
        try:
            yield
        except BaseException:
            self.reset()
            raise

    @property
    def num_tokens(self) -> int:
        """Entries held."""
        return int(self.token_ids.shape[0])

    def matching_prefix(self, layout: PromptLayout) -> int:
        """How many leading entries ``layout`` can keep as they are: same ids and positions, never part of an
        image, and always fewer than the prompt's tokens (its last token is computed to give logits). Reads
        only."""
        ids, positions = layout.token_ids, layout.positions
        n = min(self.num_tokens, int(ids.shape[0]) - 1)
        if n <= 0:
            return 0
        same = (self.token_ids[:n] == ids[:n]) & (self.positions[:, :n] == positions[:, :n]).all(0)
        keep = n if bool(same.all()) else int((~same).nonzero()[0])
        at = bisect.bisect_right(layout.pieces, keep, key=lambda p: p.begin) - 1  # the piece holding keep
        if at >= 0 and layout.pieces[at].kind == "image" and layout.pieces[at].begin < keep:
            keep = layout.pieces[at].begin  # never keep half an image
        for piece in layout.pieces[: max(at, 0) + 1]:  # same ids and positions; but the same images?
            if piece.kind == "image" and piece.begin < keep:
                if self.image_digests.get(piece.begin) != layout.digest_of(piece):
                    return piece.begin
        return keep

    def holds(self, layout: PromptLayout) -> bool:
        """Whether the cache holds exactly ``layout``'s prompt (ids, positions and images). Reads only."""
        return (
            self.num_tokens == layout.num_tokens
            and torch.equal(self.token_ids, layout.token_ids)
            and torch.equal(self.positions, layout.positions)
            and self.image_digests
            == {p.begin: layout.digest_of(p) for p in layout.pieces if p.kind == "image"}
        )

    def truncate(self, keep: int, collect_text: bool = False) -> list[KVSegment]:
        """Crop to the first ``keep`` entries. With ``collect_text``, the text pieces cut off whole come back as
        segments (copies, read before cropping; for ``kv`` reuse of text that moved)."""
        if not 0 <= keep <= self.num_tokens:
            raise ValueError(f"cannot keep {keep} of {self.num_tokens} live entries")
        whole = bisect.bisect_right(self.pieces, keep, key=lambda piece: piece.end)  # pieces ending by keep
        later = bisect.bisect_left(
            self.pieces, keep, key=lambda piece: piece.begin
        )  # pieces starting at keep on
        cut = [p for p in self.pieces[later:] if p.kind == "text"] if collect_text else []
        segments = []
        if cut:  # one copy of the cut-off tail; each text piece a view of it
            tail = self.segment(cut[0].begin, cut[-1].end)
            segments = [tail.slice(p.begin - cut[0].begin, p.end - cut[0].begin) for p in cut]
        crop_cache(self.cache, keep)
        self.token_ids = self.token_ids[:keep]
        self.positions = self.positions[:, :keep]
        self.pieces = self.pieces[:whole]
        self.image_digests = {b: d for b, d in self.image_digests.items() if b < keep}
        self.prompt_tokens = min(self.prompt_tokens, keep)
        return segments

    def segment(
        self, begin: int = 0, end: int | None = None, kind: SegmentKind = "text", digest: str = ""
    ) -> KVSegment:
        """Entries ``[begin, end)`` as a segment (a copy of their K/V, ids and positions). Changes nothing."""
        end = self.num_tokens if end is None else end
        if not 0 <= begin < end <= self.num_tokens:
            raise ValueError(f"no live entries [{begin}, {end}) in a cache of {self.num_tokens}")
        return segment_from_cache(
            self.cache,
            begin,
            self.token_ids[begin:end],
            self.positions[:, begin:end],
            self.handle.rotary,
            kind,
            digest,
        )

    def copy_prefix(self, keep: int) -> LiveCache:
        """A new live cache holding this one's first ``keep`` entries (their KV, ids, positions, pieces and
        image digests), in O(layers): its K/V are views of this cache's tensors. Changes nothing here.

        Sharing is safe because no K/V tensor of a live cache is ever written in place before a
        ``DynamicCache.update`` (which concatenates into a new tensor) has replaced it: the only in-place write,
        ``reorder_tail``, runs after ``append_spliced`` / ``forward`` in the same plan."""
        if not 0 < keep <= self.num_tokens:
            raise ValueError(f"cannot copy {keep} of {self.num_tokens} live entries")
        other = LiveCache(self.handle)
        other.cache = copy.copy(self.cache)
        other.cache.layers = [copy.copy(layer) for layer in self.cache.layers]  # own layer objects
        crop_cache(other.cache, keep)  # views of the shared tensors
        other.token_ids, other.positions = self.token_ids[:keep], self.positions[:, :keep]
        other.pieces = tuple(p for p in self.pieces if p.end <= keep)
        other.image_digests = {b: d for b, d in self.image_digests.items() if b < keep}
        other.prompt_tokens = min(self.prompt_tokens, keep)
        return other

    def layer_prefix(self, keep: int, num_layers: int) -> DynamicCache:
        """A scratch ``DynamicCache`` holding copies of the first ``keep`` entries of the first ``num_layers``
        layers (for a shallow recompute that must not touch this cache). Changes nothing here."""
        scratch = DynamicCache()
        for index, layer in enumerate(self.cache.layers[:num_layers]):
            scratch.update(layer.keys[:, :, :keep].clone(), layer.values[:, :, :keep].clone(), index)
        return scratch

    # ------------------------------------------------------------------ batched decoding (mmkv.engine.batch)
    def padded_layers(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's ``(keys, values)``, each ``(1, kv_heads, length, D)``, the entries held placed last
        after ``length - num_tokens`` zero entries (left padding: a batch row). Views when no padding is
        needed, else copies; changes nothing here."""
        pad = length - self.num_tokens
        if pad < 0:
            raise ValueError(f"cannot lay {self.num_tokens} entries out in {length}")
        layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        if pad == 0:
            return layers
        return [(torch.nn.functional.pad(k, (0, 0, pad, 0)), torch.nn.functional.pad(v, (0, 0, pad, 0)))
                for k, v in layers]  # fmt: skip

    def take_decoded(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        token_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Say that decoded tokens ``token_ids`` (``(n,)``) at ``positions`` (``(3, n)``) were computed elsewhere
        (a batched decode step): ``layers`` (per layer ``(keys, values)``, ``(1, kv_heads, num_tokens + n, D)``:
        the entries held, unchanged, then the new ones) replace the cache's tensors, and the tokens are recorded
        as part of the last piece."""
        if len(layers) != len(self.cache.layers):
            raise ValueError(f"{len(layers)} layers given, the cache has {len(self.cache.layers)}")
        n = int(token_ids.reshape(-1).shape[0])
        for layer, (keys, values) in zip(self.cache.layers, layers, strict=True):
            if keys.shape[2] != self.num_tokens + n:
                raise ValueError(f"{keys.shape[2]} entries given for {self.num_tokens} held + {n} decoded")
            layer.keys, layer.values = keys, values
        self.append_tokens(token_ids, positions)

    # ----------------------------------------------------------------- executing a plan (mmkv.runtime.execute)
    def append_spliced(self, segment: KVSegment) -> None:
        """Append ``segment``'s K and V (already at their prompt positions) after the entries held. The
        bookkeeping (ids, positions, pieces) is out of date until ``mark_prompt``."""
        append_to_cache(self.cache, segment)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        features: Sequence[ImageFeatures] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model over ``token_ids`` (``(n,)``) at ``positions`` (``(3, n)``) after every entry held
        (or under ``attention_mask``), appending their KV; returns the last one's ``(vocab,)`` logits and adds
        the call's time (the device waited for) to ``forward_seconds``. The bookkeeping is out of date until
        ``mark_prompt`` (a plan) or see ``extend`` (decoding)."""
        started = time.perf_counter()
        try:
            return prefill_span(
                self.handle, token_ids, positions, context=self.cache, features=features,
                attention_mask=attention_mask, keep_segment=False,
            ).logits  # fmt: skip
        finally:
            if self.handle.device.type == "cuda":
                torch.cuda.synchronize(self.handle.device)
            self.forward_seconds += time.perf_counter() - started

    def reorder_tail(self, keep: int, order: torch.Tensor) -> None:
        """Permute the entries from ``keep`` on: entry ``keep + i`` becomes the old ``keep + order[i]``."""
        reorder_cache(self.cache, keep, order)

    def probe(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor
    ) -> PrefillResult:
        """Run ``token_ids`` as queries over the cache under ``attention_mask`` with attention weights returned
        (the eager variant of the model); the cache is cropped back afterwards, bit for bit as before."""
        held = self.cache.get_seq_length()
        try:
            return prefill_span(
                self.handle, token_ids, positions, context=self.cache, attention_mask=attention_mask,
                attentions=True, keep_segment=False,
            )  # fmt: skip
        finally:
            crop_cache(self.cache, held)

    def extend(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append decoded tokens ``token_ids`` (``(n,)``) at ``positions`` (``(3, n)``): their KV computed and
        recorded, counted as part of the last piece. Returns the last one's ``(vocab,)`` logits."""
        logits = self.forward(token_ids, positions)
        self.append_tokens(token_ids, positions)
        return logits

    def mark_prompt(self, layout: PromptLayout) -> None:
        """Say that the cache now holds exactly ``layout``'s prompt (called once its KV is in place)."""
        assert self.cache.get_seq_length() == layout.num_tokens, "the cache does not hold the whole prompt"
        self.token_ids, self.positions = layout.token_ids.clone(), layout.positions.clone()
        self.pieces = layout.pieces
        self.image_digests = {p.begin: layout.digest_of(p) for p in layout.pieces if p.kind == "image"}
        self.prompt_tokens = layout.num_tokens

    def append_tokens(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Say that the cache grew by ``token_ids`` (``(n,)``) at ``positions`` (``(3, n)``): decoded tokens,
        counted as part of the last piece (``extend`` computes and appends them)."""
        self.token_ids = torch.cat([self.token_ids, token_ids.reshape(-1).cpu()])
        self.positions = torch.cat([self.positions, positions.cpu()], dim=1)
        assert self.cache.get_seq_length() == self.num_tokens, "cache and bookkeeping disagree"
        if self.pieces:
            last = self.pieces[-1]
            self.pieces = (*self.pieces[:-1], replace(last, length=self.num_tokens - last.begin))

    @property
    def next_position(self) -> int:
        """The position a token appended now takes (one past the largest held)."""
        return int(self.positions.max()) + 1 if self.num_tokens else 0
