"""``DecodeBatch``: the running sequences' KV as one left-padded batch, decoded one token each per forward call.

Each running sequence brings its own live cache (a prompt prefilled with its splices and repairs: a different
length per sequence, its positions wherever M-RoPE put them). The batch lays them out as rows of one
transformers ``DynamicCache`` of width ``T``, each row's entries placed last after zero padding; one step runs
the model over ``(B, 1)`` tokens at their own ``(3, B, 1)`` positions under a ``(B, 1, 1, T + 1)`` mask that
hides each row's padding, and appends one column for all rows. Example, rows of 3 and 5 entries::

    row 0:  . . a a a | x        (pad 2; x is row 0's new token)
    row 1:  b b b b b | y        (pad 0)

Why padded rows and not pages that splices are copied into: mmkv's prompts are assembled from spliced
segments, so a page table would need a copy of every splice anyway, and on the sizes this engine serves
(batches of 1-16, prompts of 10^2-10^4 tokens) building a batch costs one copy of the rows when a sequence
joins or leaves, while every step costs what a single sequence's ``DynamicCache`` already costs (one
concatenation per layer). The padding is measured: ``bench/batch.py`` prints it.

Exactness: a row's padding is masked out (it gets no attention weight), so a batched step computes what that
sequence alone would, up to the rounding of batched matrix products (about 1e-6 in float32; the engine's
tests bound it). With one row and no padding the call is exactly the single-sequence one (no mask).

Only ``join``, ``leave`` and ``step`` change the batch; ``leave`` hands a row's KV back to its live cache
(``LiveCache.take_decoded``), so a finished sequence's cache is what decoding it alone would have left.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ..compat import cache_argument_name
from ..model.handle import ModelHandle
from ..runtime.live import LiveCache

__all__ = ["DecodeBatch"]


class DecodeBatch:
    """Running live caches as rows of one padded cache. Not thread-safe (the engine's model thread owns it)."""

    def __init__(self, handle: ModelHandle) -> None:
        self.handle = handle
        self.rows: list[LiveCache] = []  # row b's live cache (its held entries, before this batch's steps)
        self._pads: list[int] = []  # row b's padding entries, on the left
        self._decoded: list[list[tuple[int, int]]] = []  # row b's (token, position) appended by steps
        self._cache: DynamicCache | None = None  # (B, kv_heads, width, D) per layer
        self.width = 0  # entries per row, padding included
        eager = handle.model.config.get_text_config()._attn_implementation == "eager"
        self._mask_dtype = handle.dtype if eager else torch.bool  # eager adds the mask; sdpa takes booleans

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def padding(self) -> int:
        """Padding entries over all rows (what the layout costs beyond the sequences' own KV)."""
        return sum(self._pads)

    def join(self, live: LiveCache) -> None:
        """Add ``live`` (a prefilled cache; its entries are not changed) as the last row. Copies every row into
        a new batch cache once (the rows padded on the left to the new width)."""
        if any(row is live for row in self.rows):
            raise ValueError("this live cache is in the batch already")
        if live.num_tokens == 0:
            raise ValueError("an empty live cache cannot decode")
        width = max(self.width, live.num_tokens)
        layers = [live.padded_layers(width)]
        if self.rows:
            layers.insert(0, self._padded(width - self.width))
        self._cache = _cache_of(self.handle, [_cat_rows(parts) for parts in zip(*layers, strict=True)])
        self._pads = [p + width - self.width for p in self._pads] + [width - live.num_tokens]
        self.rows.append(live)
        self._decoded.append([])
        self.width = width

    def leave(self, live: LiveCache) -> None:
        """Take ``live``'s row out: its KV (held entries plus those the steps appended) goes back to ``live``
        (a copy of the row, so the batch's memory is not kept alive by it), the other rows stay as they were."""
        b = next((i for i, row in enumerate(self.rows) if row is live), None)
        if b is None:
            raise ValueError("this live cache is not in the batch")
        decoded = self._decoded[b]
        if decoded:
            pad = self._pads[b]
            row = [(k[b : b + 1, :, pad:].clone(), v[b : b + 1, :, pad:].clone()) for k, v in self._layers()]
            tokens = torch.tensor([t for t, _ in decoded], dtype=torch.long)  # (n,)
            positions = torch.tensor([p for _, p in decoded], dtype=torch.long).expand(3, -1)  # (3, n)
            live.take_decoded(row, tokens, positions.contiguous())
        del self.rows[b], self._pads[b], self._decoded[b]
        if not self.rows:
            self._cache, self.width = None, 0
            return
        keep = torch.tensor([i for i in range(len(self._pads) + 1) if i != b])  # (B - 1,)
        trim = min(self._pads)  # padding every row has: dropped
        layers = [(k.index_select(0, keep.to(k.device))[:, :, trim:], v.index_select(0, keep.to(v.device))[:, :, trim:])
                  for k, v in self._layers()]  # fmt: skip
        self._cache = _cache_of(self.handle, layers)
        self._pads = [p - trim for p in self._pads]
        self.width -= trim

    def step(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One forward call: row b's ``tokens[b]`` at text position ``positions[b]`` (``(p, p, p)``), appended
        to every row. Returns the ``(B, vocab)`` float32 logits after each, on the model's device."""
        if len(tokens) != len(self.rows) or len(positions) != len(self.rows):
            raise ValueError(f"{len(tokens)} tokens and {len(positions)} positions for {len(self.rows)} rows")
        device, batch = self.handle.device, len(self.rows)
        ids = torch.tensor(tokens, dtype=torch.long).reshape(batch, 1)  # (B, 1)
        pos = torch.tensor(positions, dtype=torch.long).reshape(1, batch, 1).expand(3, batch, 1)  # (3, B, 1)
        kwargs = {
            "input_ids": ids.to(device),
            "position_ids": pos.to(device),
            cache_argument_name(self.handle.model): self._cache,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if any(self._pads):  # one row or no padding: the plain causal call, exactly a single sequence's
            pads = torch.tensor(self._pads, device=device)  # (B,)
            visible = torch.arange(self.width + 1, device=device)[None, :] >= pads[:, None]  # (B, T + 1)
            if self._mask_dtype == torch.bool:
                kwargs["attention_mask"] = visible[:, None, None, :]  # (B, 1, 1, T + 1)
            else:
                mask = torch.zeros(visible.shape, dtype=self._mask_dtype, device=device)
                kwargs["attention_mask"] = mask.masked_fill_(~visible, torch.finfo(self._mask_dtype).min)[
                    :, None, None, :
                ]  # (B, 1, 1, T + 1)
        logits = self.handle.model(**kwargs).logits[:, -1].float()  # (B, vocab)
        self.width += 1
        for decoded, token, position in zip(self._decoded, tokens, positions, strict=True):
            decoded.append((int(token), int(position)))
        return logits

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self._cache.layers]

    def _padded(self, extra: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rows' layers with ``extra`` more padding entries on the left (views when none)."""
        if extra == 0:
            return self._layers()
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, extra, 0))  # noqa: E731
        return [(pad(k), pad(v)) for k, v in self._layers()]


def _cat_rows(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``(keys, values)`` of several row groups, stacked on the batch axis (views for one)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])


def _cache_of(handle: ModelHandle, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` holding ``layers`` (per layer ``(keys, values)``, ``(B, kv_heads, T, D)``)."""
    cache = DynamicCache(config=handle.text_config)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache
