"""``Session``: a multi-turn trajectory over one model that never pays twice for the same picture.

The session holds the conversation (messages whose image items point into its list of images) and one live
``DynamicCache``. Each turn renders the whole conversation with the model's own chat template and processor
(so the token ids are exactly the processor's) and brings the live cache up to date with the least work:

1. the longest prefix whose token ids and positions match the live cache is kept as it is (exact);
2. every later piece is planned:
   - an image: under ``reuse="kv"`` its cached KV (``ImageKVStore``) is spliced, re-rotated to its new start,
     and its first ``seam`` tokens are recomputed in context; under ``"encoder"`` its cached vision-tower output
     (``EncoderStore``) is prefilled in context (exact); under ``"none"`` the vision tower and prefill run
     afresh. On a miss the image is computed in context (and, under ``"kv"``, its KV stored);
   - a text run is computed; under ``"kv"`` a run identical to one cut off the live cache (the text after an
     image that left the ``window``) is spliced from there instead, re-rotated;
3. the plan runs as **one** forward call: spliced segments are appended first, then every token to compute runs
   together under an attention mask that lets each see exactly what precedes it in the prompt; the cache is
   then put back in prompt order. The answer is decoded greedily.

Text takes part too: ``add_text(..., fields=...)`` declares editable values that ``edit`` changes in the live
cache by one of the strategies of ``mmkv.text.edit``, and ``add_segment`` splices a precompiled text segment
(``mmkv.text.precompile``) like a cached image. ``prefill`` brings the cache up to the conversation without a
question.

Splicing KV computed after another prefix is an approximation (position-independent caching); the eval
measures it. Re-rotation itself is exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from PIL import Image

from .cache import EncoderStore, ImageDigest, ImageKVStore, image_digest
from .compat import crop_cache
from .errors import StoreMismatchError
from .images import DEFAULT_MAX_PIXELS, ImageSource, load_image
from .kv import ImageFeatures, KVSegment, encode_images, new_cache, prefill_span, segment_from_cache
from .kv.segment import append_to_cache, reorder_cache
from .model.handle import ModelHandle
from .prompt import PromptPiece, RenderedPrompt, layout_positions, render_prompt, split_prompt

__all__ = ["Answer", "ImageReuse", "PrefillStats", "ReusePolicy", "Session", "SessionConfig"]

ReusePolicy = Literal["kv", "encoder", "none"]
ImageSourceKind = Literal["live", "memory", "disk", "computed"]


@dataclass(frozen=True)
class SessionConfig:
    """How a session reuses work. Validated on construction."""

    reuse: ReusePolicy = "kv"  # "kv" (splice cached KV), "encoder" (cached vision outputs), "none"
    seam: int = 1  # kv: leading tokens of a spliced image recomputed in context (0: pure splice)
    window: int | None = None  # keep only the last N images in the prompt (None: all)
    rotate: bool = True  # kv: re-rotate spliced keys (False only for the no-rotation control)
    rotate_axes: tuple[int, ...] = (0, 1, 2)  # kv: axes re-rotated; (0,) is the temporal-only ablation
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # refuse larger inputs (decompression bombs)

    def __post_init__(self) -> None:
        if self.reuse not in ("kv", "encoder", "none"):
            raise ValueError(f"reuse must be 'kv', 'encoder' or 'none', got {self.reuse!r}")
        if self.seam < 0:
            raise ValueError(f"seam must be >= 0, got {self.seam}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be None or >= 1, got {self.window}")
        if not set(self.rotate_axes) <= {0, 1, 2}:
            raise ValueError(f"rotate_axes must be a subset of (0, 1, 2), got {self.rotate_axes}")


@dataclass(frozen=True)
class ImageReuse:
    """Where one image of a turn came from."""

    index: int  # the image's number in the session (0-based, in order of add_image)
    digest: ImageDigest  # its content digest
    source: (
        ImageSourceKind  # "live" (kept prefix), "memory"/"disk" (store tier), "computed" (vision tower ran)
    )


@dataclass(frozen=True)
class Answer:
    """The result of one ``ask``."""

    text: str  # the decoded answer, special tokens removed
    token_ids: tuple[int, ...]  # generated ids (the end-of-turn token included when produced)
    ttft_s: float  # seconds from the call to the first answer token
    total_s: float  # seconds for the whole call
    prompt_tokens: int  # tokens in the rendered prompt
    prefilled_tokens: int  # prompt tokens run through the language model this turn
    reused_tokens: int  # prompt tokens whose KV came from the live cache or a store
    images: tuple[ImageReuse, ...]  # one entry per image in the prompt


@dataclass(frozen=True)
class _Image:
    """An image the session holds."""

    pixels: Image.Image  # normalised RGB
    digest: ImageDigest  # content key (pixels + processor + model)
    grid: tuple[int, int, int]  # vision grid it is processed at


@dataclass
class _LivePiece:
    """A piece of the prompt whose KV sits in the live cache."""

    kind: Literal["text", "image"]
    begin: int  # first cache entry
    token_ids: torch.Tensor  # (L,)

    @property
    def length(self) -> int:
        """Tokens in the piece."""
        return int(self.token_ids.shape[0])


@dataclass
class PrefillStats:
    """What bringing the live cache up to one prompt took."""

    prompt_tokens: int = 0  # tokens in the prompt
    prefilled: int = 0  # tokens run through the language model
    reused: int = 0  # tokens whose KV came from the live cache or a store
    images: list[ImageReuse] = field(default_factory=list)  # where each image of the prompt came from
    seconds: float = 0.0  # from rendering to the first token's logits on the host; store writes excluded


class Session:
    """A conversation over one model with image and KV reuse. Not thread-safe; one live cache per session."""

    def __init__(
        self,
        model: ModelHandle,
        store: ImageKVStore | None = None,
        reuse: ReusePolicy = "kv",
        seam: int = 1,
        window: int | None = None,
        *,
        encoder_store: EncoderStore | None = None,
        config: SessionConfig | None = None,
    ) -> None:
        """``store``/``encoder_store`` default to private in-memory stores; pass shared ones (optionally with a
        directory) to reuse images across sessions and processes. ``config`` overrides the keyword settings."""
        self.model = model
        self.config = config or SessionConfig(reuse=reuse, seam=seam, window=window)
        self.store = store if store is not None else ImageKVStore()
        self.encoder_store = encoder_store if encoder_store is not None else EncoderStore()
        if not isinstance(self.store, ImageKVStore):
            raise StoreMismatchError(f"store must be an ImageKVStore, got {type(self.store).__name__}")
        if not isinstance(self.encoder_store, EncoderStore):
            raise StoreMismatchError(
                f"encoder_store must be an EncoderStore, got {type(self.encoder_store).__name__}"
            )
        self.messages: list[dict] = []  # chat messages; image items carry "image_index", text items "item_id"
        self.images: list[_Image] = []
        self.field_values: dict[str, str] = {}  # current value of each named field (see add_text, edit)
        self._next_item_id = 0
        self.last_prefill = PrefillStats()  # what the latest ask / next_token_logits took
        self._reset_live()

    # ----------------------------------------------------------------------------------------- conversation
    def add_text(
        self,
        text: str,
        role: str = "user",
        fields: dict[str, str] | None = None,
        *,
        new_message: bool = False,
    ) -> None:
        """Append ``text`` to the conversation as ``role`` (joined to the last message if it has that role,
        unless ``new_message``).

        ``fields`` names editable values: ``add_text("account_role: {role}", fields={"role": "admin"})`` renders
        "account_role: admin", and ``edit("role", ...)`` changes it later. Each ``{name}`` must occur once in
        ``text``, and a name once per session. Raises ``TypeError``/``ValueError`` (the session is unchanged).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        item = self._text_item(text, fields or {})
        self._append_item(role, item, new_message=new_message)
        self.field_values.update(item.get("fields", {}))

    def add_segment(self, segment: KVSegment, seam: int = 1, role: str = "user") -> None:
        """Append a precompiled text segment (``mmkv.text.precompile``) as ``role``'s text. Under ``reuse="kv"``
        its cached KV is spliced, re-rotated to where it lands, with its first ``seam`` tokens recomputed in
        context; where the rendered tokens differ from the segment's (another tokenisation at a joint, or an
        edited field), or under another policy, the text is computed like any other."""
        from .text.compose import TextSegment

        if not isinstance(segment, TextSegment):
            raise TypeError(
                f"add_segment takes a TextSegment from mmkv.text.precompile, got {type(segment).__name__}"
            )
        if seam < 0:
            raise ValueError(f"seam must be >= 0, got {seam}")
        item = self._text_item(segment.template, dict(segment.fields))
        item |= {"segment": segment, "seam": seam}
        self._append_item(role, item)
        self.field_values.update(item.get("fields", {}))

    def _text_item(self, template: str, fields: dict[str, str]) -> dict:
        """A text item (with a fresh ``item_id``), its fields checked and filled in."""
        from .prompt.fields import fill_template, validate_fields

        fields = validate_fields(template, fields)
        taken = sorted(set(fields) & set(self.field_values))
        if taken:
            raise ValueError(f"field {taken[0]!r} already exists in this session; field names must be unique")
        item = {"type": "text", "text": fill_template(template, fields)[0], "item_id": self._next_item_id}
        if fields:
            item |= {"template": template, "fields": fields}
        self._next_item_id += 1
        return item

    def field_item(self, name: str) -> dict:
        """The text item holding field ``name``; ``KeyError`` naming the known fields if there is none."""
        for message in self.messages:
            for item in message["content"]:
                if name in item.get("fields", {}):
                    return item
        raise KeyError(f"no field {name!r} in this session; fields: {sorted(self.field_values)}")

    def add_image(self, image: ImageSource) -> ImageDigest:
        """Append an image (PIL image, path or bytes) to the current user message; returns its digest.

        Raises an ``mmkv.ImageError`` / ``UnsupportedInputError`` for bad input, leaving the session unchanged.
        """
        pixels = load_image(image, max_pixels=self.config.max_image_pixels)
        processor = self.model.processor
        record = _Image(
            pixels, image_digest(pixels, processor, self.model.fingerprint), processor.image_grid(pixels)
        )
        self.images.append(record)
        self._append_item("user", {"type": "image", "image_index": len(self.images) - 1})
        return record.digest

    def fork(self, **settings) -> Session:
        """A new session over the same model and stores with a copy of this conversation and an empty live
        cache; ``settings`` override this session's ``SessionConfig`` fields (e.g. ``reuse="none"``)."""
        other = Session(
            self.model,
            store=self.store,
            encoder_store=self.encoder_store,
            config=replace(self.config, **settings),
        )
        other.messages = [dict(m, content=[_copy_item(item) for item in m["content"]]) for m in self.messages]
        other.images = list(self.images)
        other.field_values = dict(self.field_values)
        other._next_item_id = self._next_item_id
        return other

    def clear(self) -> None:
        """Forget the conversation and the live cache (the stores keep their entries)."""
        self.messages.clear()
        self.images.clear()
        self.field_values.clear()
        self._reset_live()

    @torch.inference_mode()
    def ask(self, question: str, max_new_tokens: int = 32) -> Answer:
        """Ask ``question`` as the user, decode the answer greedily, append both to the conversation.

        On an error the conversation is left as it was (the live cache is dropped and rebuilt next turn).
        """
        started = time.perf_counter()
        try:
            logits, turn = self._prefill_conversation(question)
            ttft = time.perf_counter() - started
            self._commit_stores()
            generated = self._decode(logits, max_new_tokens)
        except BaseException:
            self._reset_live()
            raise
        text = self.model.tokenizer.decode(generated, skip_special_tokens=True).strip()
        self.add_text(question, "user")
        self._append_item("assistant", {"type": "text", "text": text})
        return Answer(
            text=text,
            token_ids=tuple(generated),
            ttft_s=ttft,
            total_s=time.perf_counter() - started,
            prompt_tokens=turn.prompt_tokens,
            prefilled_tokens=turn.prefilled,
            reused_tokens=turn.reused,
            images=tuple(turn.images),
        )

    @torch.inference_mode()
    def next_token_logits(self, question: str) -> torch.Tensor:
        """``(vocab,)`` float32 logits of the first answer token to ``question``. The conversation is unchanged
        (the live cache may hold the question afterwards; the next turn reuses what still matches)."""
        try:
            logits, _ = self._prefill_conversation(question)
            self._commit_stores()
        except BaseException:
            self._reset_live()
            raise
        return logits

    def prefill(self) -> PrefillStats:
        """Bring the live cache up to the conversation as it stands, with no question (e.g. while the user is
        still typing, or before an edit). Returns what it took; nothing is computed when the cache is current."""
        with torch.inference_mode():
            rendered, order = self.render_prompt(None, add_generation_prompt=False, trace=False)
            n = int(rendered.token_ids.shape[0])
            if n == 0:
                return PrefillStats()
            ids, positions, _ = self.layout(rendered, order)
            if (
                self.live_tokens == n
                and torch.equal(self._live_ids, ids)
                and torch.equal(self._live_positions, positions)
            ):
                return PrefillStats(prompt_tokens=n, reused=n)
            try:
                _, turn = self._prefill_conversation(None, add_generation_prompt=False)
                self._commit_stores()
            except BaseException:
                self._reset_live()
                raise
            return turn

    def edit(self, name: str, value: str, strategy: str = "suffix", **options):
        """Change field ``name`` to ``value`` in the context by ``strategy``: "erratum", "in_place",
        "selective" (options ``k``, ``rank``), "suffix" (exact) or "full"; returns an ``mmkv.text.EditReport``.
        See ``mmkv.text.edit`` for what each does."""
        from .text.edit import edit_field

        return edit_field(self, name, value, strategy, **options)

    # ------------------------------------------------------------------------------------------- rendering
    def render(
        self, question: str | None = None, add_generation_prompt: bool = True
    ) -> tuple[torch.Tensor, list[int]]:
        """The prompt's token ids ``(L,)`` and the session indices of the images in it (after the window), with
        ``question`` joined to the conversation as the user's last words. Changes nothing."""
        rendered, order = self.render_prompt(question, add_generation_prompt, trace=False)
        return rendered.token_ids, order

    def render_prompt(
        self, question: str | None = None, add_generation_prompt: bool = True, trace: bool = True
    ) -> tuple[RenderedPrompt, list[int]]:
        """``render``, as a ``RenderedPrompt`` (ids with the token spans of text items and field values; without
        them, at the cost of a plain rendering, when not ``trace``)."""
        visible = self._visible_images()
        messages = []
        for message in self.messages:
            content = [
                item
                for item in message["content"]
                if item["type"] != "image" or item["image_index"] in visible
            ]
            messages.append({"role": message["role"], "content": content})
        if question is not None:
            item = {"type": "text", "text": question}
            if messages and messages[-1]["role"] == "user":
                messages[-1]["content"] = [*messages[-1]["content"], item]
            else:
                messages.append({"role": "user", "content": [item]})
        order = [item["image_index"] for m in messages for item in m["content"] if item["type"] == "image"]
        grids = torch.tensor([self.images[i].grid for i in order], dtype=torch.long).reshape(-1, 3)
        return render_prompt(self.model.processor, messages, grids, add_generation_prompt, trace), order

    def layout(
        self, rendered: RenderedPrompt, order: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[PromptPiece]]:
        """``(ids (L,), positions (3, L), pieces)`` of a rendered prompt."""
        grids = torch.tensor([self.images[i].grid for i in order], dtype=torch.long).reshape(-1, 3)
        pieces = split_prompt(self.model, rendered.token_ids, grids)
        return rendered.token_ids, torch.cat(layout_positions(self.model, pieces), dim=1), pieces

    def _visible_images(self) -> set[int]:
        window = self.config.window
        first = 0 if window is None else max(0, len(self.images) - window)
        return set(range(first, len(self.images)))

    def _append_item(self, role: str, item: dict, new_message: bool = False) -> None:
        if self.messages and self.messages[-1]["role"] == role and not new_message:
            self.messages[-1]["content"].append(item)
        else:
            self.messages.append({"role": role, "content": [item]})

    # --------------------------------------------------------------------------------------- live cache
    def reset_live(self) -> None:
        """Drop the live cache (the conversation stays; the next turn rebuilds what it needs)."""
        self._reset_live()

    def truncate_live(self, keep: int) -> None:
        """Keep only the first ``keep`` entries of the live cache."""
        self._truncate_live(min(keep, self.live_tokens))

    def replace_tokens(
        self,
        rendered: RenderedPrompt,
        order: list[int],
        begin: int,
        old_end: int,
        new_end: int,
        extra: Sequence[int] = (),
    ) -> None:
        """Make the live cache hold ``rendered`` by recomputing only tokens ``[begin, new_end)`` and the prompt
        indices ``extra`` (all >= ``new_end``), in context; the live entries from ``old_end`` on are kept for the
        tokens from ``new_end`` on, re-rotated by ``new_end - old_end`` (their content is not updated)."""
        ids, positions, pieces = self.layout(rendered, order)
        n_old = self.live_tokens
        if int(ids.shape[0]) - new_end != n_old - old_end or not 0 <= begin <= min(new_end, old_end):
            raise ValueError("replace_tokens: the spans do not match the live cache and the rendering")
        downstream = None
        if old_end < n_old:
            downstream = segment_from_cache(
                self._cache,
                old_end,
                self._live_ids[old_end:],
                self._live_positions[:, old_end:],
                self.model.layout,
            )
        crop_cache(self._cache, begin)
        plan = _Plan()
        if new_end > begin:
            plan.compute(begin, new_end - begin)
        cursor = new_end
        for index in sorted(extra):
            if index < new_end or index >= ids.shape[0]:
                raise ValueError(
                    f"replace_tokens: extra index {index} is outside [{new_end}, {ids.shape[0]})"
                )
            if index > cursor:
                plan.splice(cursor, downstream.slice(cursor - new_end, index - new_end))
            plan.compute(index, 1)
            cursor = index + 1
        if cursor < ids.shape[0]:
            plan.splice(cursor, downstream.slice(cursor - new_end))
        plan.features = self.pad_features(
            pieces, order, [i for s, n in plan.computed for i in range(s, s + n)]
        )
        self._execute(plan, ids, positions, begin)
        self._set_live(ids, positions, pieces)
        self._commit_stores()

    def pad_features(self, pieces: Sequence[PromptPiece], order: list[int], indices) -> list[ImageFeatures]:
        """The vision outputs of the image pads among prompt ``indices``, in order (one record per image)."""
        wanted = sorted(set(indices))
        out, begin = [], 0
        for piece in pieces:
            if piece.kind == "image":
                rows = [i - begin - 1 for i in wanted if begin < i < begin + piece.length - 1]
                if rows:
                    full = self._features(self.images[order[piece.image_index]])[0][0]
                    index = torch.tensor(rows, device=full.embeds.device)
                    out.append(ImageFeatures(full.embeds[index], tuple(d[index] for d in full.deepstack)))
            begin += piece.length
        return out

    def _set_live(self, ids: torch.Tensor, positions: torch.Tensor, pieces: Sequence[PromptPiece]) -> None:
        """Record that the live cache holds the prompt ``ids`` at ``positions``, cut into ``pieces``."""
        self._live_ids, self._live_positions = ids.clone(), positions.clone()
        self._live_pieces = []
        begin = 0
        for piece in pieces:
            self._live_pieces.append(_LivePiece(piece.kind, begin, piece.token_ids))
            begin += piece.length

    def _reset_live(self) -> None:
        self._pending_puts: list = []  # store writes of the turn in progress (see _commit_stores)
        self._turn_features: dict[str, list[ImageFeatures]] = {}  # vision outputs computed this turn
        self._cache = new_cache(self.model)
        self._live_ids = torch.zeros(0, dtype=torch.long)  # (N,) ids in the cache
        self._live_positions = torch.zeros(3, 0, dtype=torch.long)  # (3, N)
        self._live_pieces: list[_LivePiece] = []

    def live_segment(self) -> KVSegment | None:
        """The whole live cache as one segment (a copy of its K/V, ids and positions), or None when empty."""
        if not self.live_tokens:
            return None
        return segment_from_cache(
            self._cache, 0, self._live_ids, self._live_positions, self.model.layout, "text"
        )

    @property
    def live_tokens(self) -> int:
        """Tokens whose KV is in the live cache."""
        return int(self._live_ids.shape[0])

    def _prefill_conversation(
        self, question: str | None, add_generation_prompt: bool = True
    ) -> tuple[torch.Tensor, PrefillStats]:
        started = time.perf_counter()
        rendered, order = self.render_prompt(question, add_generation_prompt, trace=self._has_segments())
        ids, positions, pieces = self.layout(rendered, order)
        keep = self._matching_prefix(ids, positions, pieces)
        turn = PrefillStats(prompt_tokens=int(ids.shape[0]), reused=keep)
        reusable_text = self._truncate_live(keep)
        anchors = self._segment_anchors(rendered, keep)
        logits = self._fill(
            pieces, order, ids, positions, keep, reusable_text, turn, anchors
        ).cpu()  # waits for the device
        turn.seconds = time.perf_counter() - started
        self.last_prefill = turn
        return logits, turn

    def _has_segments(self) -> bool:
        """Whether this turn may splice precompiled text segments (and so needs the prompt's item spans)."""
        return self.config.reuse == "kv" and any(
            "segment" in item for message in self.messages for item in message["content"]
        )

    def _segment_anchors(self, rendered: RenderedPrompt, keep: int) -> list[tuple[int, KVSegment, int]]:
        """``(first index, segment, seam)`` of each precompiled segment (``add_segment``) to splice this turn:
        under ``reuse="kv"``, past the kept prefix, and only where the prompt holds exactly its tokens."""
        if not self._has_segments() or rendered.item_spans is None:
            return []
        anchors = []
        for message in self.messages:
            for item in message["content"]:
                segment = item.get("segment")
                if segment is None or item["item_id"] not in rendered.item_spans:
                    continue
                begin, end = rendered.item_spans[item["item_id"]]
                if begin >= keep and torch.equal(rendered.token_ids[begin:end], segment.token_ids):
                    anchors.append((begin, segment, item["seam"]))
        return sorted(anchors, key=lambda a: a[0])

    def _matching_prefix(
        self, ids: torch.Tensor, positions: torch.Tensor, pieces: Sequence[PromptPiece]
    ) -> int:
        """Length of the live prefix to keep: same ids and positions, not inside an image, < len(ids)."""
        n = min(self.live_tokens, int(ids.shape[0]) - 1)
        same = (self._live_ids[:n] == ids[:n]) & (self._live_positions[:, :n] == positions[:, :n]).all(0)
        keep = n if bool(same.all()) else int((~same).nonzero()[0])
        begin = 0
        for piece in pieces:  # never keep half an image
            if piece.kind == "image" and begin < keep < begin + piece.length:
                return begin
            begin += piece.length
        return keep

    def _truncate_live(self, keep: int) -> list[KVSegment]:
        """Crop the live cache to ``keep`` tokens. Returns the text pieces cut off whole, as segments (read
        before cropping), for ``kv`` reuse further on."""
        cut = [p for p in self._live_pieces if p.kind == "text" and p.begin >= keep]
        segments = (
            [
                segment_from_cache(
                    self._cache,
                    p.begin,
                    p.token_ids,
                    self._live_positions[:, p.begin : p.begin + p.length],
                    self.model.layout,
                    "text",
                )
                for p in cut
            ]
            if self.config.reuse == "kv"
            else []
        )
        crop_cache(self._cache, keep)
        self._live_ids = self._live_ids[:keep]
        self._live_positions = self._live_positions[:, :keep]
        self._live_pieces = [p for p in self._live_pieces if p.begin + p.length <= keep]
        return segments

    def _fill(self, pieces, order, ids, positions, keep, reusable_text, turn, anchors=()) -> torch.Tensor:
        """Bring the live cache from ``keep`` tokens to the whole prompt in one forward call; returns the last
        token's logits.

        Cached segments (images from the store, text cut off the live cache) are appended first, re-rotated to
        their positions; then every token that must be computed runs in one call whose attention mask lets each
        token see exactly what precedes it in the prompt. The cache tail is then put back in prompt order.
        """
        plan = _Plan()
        begin = 0
        for piece in pieces:
            end = begin + piece.length
            if end <= keep:
                if piece.kind == "image":
                    index = order[piece.image_index]
                    turn.images.append(ImageReuse(index, self.images[index].digest, "live"))
                begin = end
                continue
            start = max(begin, keep)
            if piece.kind == "text":
                for first, segment, seam in anchors:  # precompiled segments inside this run
                    if start <= first and first + segment.length <= end:
                        self._plan_text(plan, start, ids[start:first], reusable_text, is_last=False)
                        self._plan_segment(
                            plan, first, segment, seam, is_last=first + segment.length == ids.shape[0]
                        )
                        start = first + segment.length
                self._plan_text(plan, start, ids[start:end], reusable_text, is_last=end == ids.shape[0])
            else:
                self._plan_image(plan, start, piece, order[piece.image_index], ids[start:end], turn)
            begin = end
        assert plan.computed and plan.computed[-1][0] + plan.computed[-1][1] == ids.shape[0], (
            "last token not computed"
        )
        logits = self._execute(plan, ids, positions, keep)
        turn.prefilled = sum(length for _, length in plan.computed)
        turn.reused = int(ids.shape[0]) - turn.prefilled
        self._set_live(ids, positions, pieces)
        for start, length, image in plan.to_store:
            self._pending_puts.append(
                lambda start=start, length=length, image=image: self.store.put(
                    image.digest,
                    segment_from_cache(
                        self._cache,
                        start,
                        ids[start : start + length],
                        positions[:, start : start + length],
                        self.model.layout,
                        "image",
                        image.digest,
                    ),
                    self.model,
                )
            )
        return logits

    def _commit_stores(self) -> None:
        """Write what this turn computed into the stores. Runs after the first token is known, so store
        writes (disk ones included) are not part of the time to first token."""
        puts, self._pending_puts = self._pending_puts, []
        self._turn_features = {}
        for put in puts:
            put()

    def _plan_text(
        self, plan: _Plan, start: int, ids: torch.Tensor, candidates: list[KVSegment], is_last: bool
    ):
        """Plan a text run: splice any cut-off live text segment it begins with (kv: text after an image that
        left the window; consumes the candidate), compute the rest. The prompt's last token is always computed."""
        while ids.shape[0] and candidates:
            limit = ids.shape[0] - (1 if is_last else 0)
            match = max(
                (c for c in candidates if c.length <= limit and torch.equal(c.token_ids, ids[: c.length])),
                key=lambda c: c.length,
                default=None,
            )
            if match is None:
                break
            candidates.remove(match)
            plan.splice(start, match)
            start, ids = start + match.length, ids[match.length :]
        if ids.shape[0]:
            plan.compute(start, int(ids.shape[0]))

    @staticmethod
    def _plan_segment(plan: _Plan, start: int, segment: KVSegment, seam: int, is_last: bool) -> None:
        """Plan a precompiled text segment: its first ``seam`` tokens computed in context, the rest spliced
        (the prompt's last token is always computed)."""
        seam = min(seam, segment.length)
        tail = 1 if is_last and seam < segment.length else 0
        if seam:
            plan.compute(start, seam)
        if seam < segment.length - tail:
            plan.splice(start + seam, segment.slice(seam, segment.length - tail))
        if tail:
            plan.compute(start + segment.length - 1, 1)

    def _plan_image(self, plan: _Plan, start: int, piece, index: int, piece_ids: torch.Tensor, turn) -> None:
        """Plan an image: splice its cached KV (kv hit; the first ``seam`` tokens computed in context from the
        cached vision outputs), or compute it from cached or fresh vision outputs (and store it, kv miss)."""
        image = self.images[index]
        reuse = self.config.reuse
        if reuse == "kv":
            segment, tier = self.store.lookup(image.digest, self.model)
            if segment is not None:
                self._check_fits(segment, piece_ids)
                turn.images.append(ImageReuse(index, image.digest, tier))
                seam = min(self.config.seam, segment.length)
                if seam:
                    num_pads = seam - 1  # the first token is <|vision_start|>
                    if num_pads:
                        full, _ = self._features(image)
                        plan.features.append(
                            ImageFeatures(
                                full[0].embeds[:num_pads], tuple(d[:num_pads] for d in full[0].deepstack)
                            )
                        )
                    plan.compute(start, seam)
                if seam < segment.length:
                    plan.splice(start + seam, segment.slice(seam))
                return
        features, source = self._features(image)
        turn.images.append(ImageReuse(index, image.digest, source))
        plan.features.extend(features)
        plan.compute(start, int(piece_ids.shape[0]))
        if reuse == "kv":
            plan.to_store.append((start, int(piece_ids.shape[0]), image))

    def _execute(self, plan: _Plan, ids: torch.Tensor, positions: torch.Tensor, keep: int) -> torch.Tensor:
        """Append the planned splices, run the planned tokens in one call, restore prompt order."""
        order = [torch.arange(keep)]  # prompt index of every cache entry, in cache order
        for start, segment in plan.splices:
            target = positions[:, start : start + segment.length]
            if self.config.rotate:
                placed = segment.moved_to(int(target[0, 0]), axes=self.config.rotate_axes)
            else:
                placed = replace(segment, position_ids=target.clone())
            append_to_cache(self._cache, placed)
            order.append(torch.arange(start, start + segment.length))
        computed = torch.cat([torch.arange(start, start + length) for start, length in plan.computed])  # (Q,)
        order.append(computed)
        entries = torch.cat(order)  # (keep + spliced + Q,)
        mask = None
        if plan.splices:  # each computed token sees exactly the entries before it in the prompt
            visible = entries[None, :] <= computed[:, None]  # (Q, K)
            mask = torch.zeros(visible.shape, dtype=self.model.dtype).masked_fill_(
                ~visible, torch.finfo(self.model.dtype).min
            )
            mask = mask[None, None].to(self.model.device)  # (1, 1, Q, K)
        result = prefill_span(
            self.model,
            ids[computed],
            positions[:, computed],
            context=self._cache,
            features=plan.features,
            attention_mask=mask,
        )
        if plan.splices:
            reorder_cache(self._cache, keep, torch.argsort(entries[keep:]))
        return result.logits

    def _check_fits(self, segment: KVSegment, token_ids: torch.Tensor) -> None:
        """Raise ``StoreMismatchError`` unless ``segment`` is KV this model could have made for ``token_ids``."""
        config = self.model.text_config
        expected = (self.model.num_layers, config.num_key_value_heads, self.model.layout.head_dim)
        found = (segment.num_layers, int(segment.keys.shape[2]), int(segment.keys.shape[-1]))
        if found != expected:
            raise StoreMismatchError(
                f"the store returned KV with (layers, kv heads, head_dim) = {found}; this model has {expected}. "
                "Use a store directory per model, or clear it"
            )
        if not torch.equal(segment.token_ids.cpu(), token_ids.cpu()):
            raise StoreMismatchError("the stored KV is for other tokens than this image's span")

    def _features(self, image: _Image) -> tuple[list[ImageFeatures], ImageSourceKind]:
        """The image's vision outputs: from the encoder store (unless reuse is "none"), else computed."""
        if self.config.reuse != "none":
            if image.digest in self._turn_features:  # computed earlier this turn, not yet stored
                return self._turn_features[image.digest], "computed"
            cached, tier = self.encoder_store.lookup(image.digest, self.model)
            if cached is not None:
                return cached, tier
        features = encode_images(self.model, self.model.processor.preprocess_images([image.pixels]))
        if self.config.reuse != "none":
            self._turn_features[image.digest] = features
            self._pending_puts.append(lambda: self.encoder_store.put(image.digest, features, self.model))
        return features, "computed"

    def _decode(self, logits: torch.Tensor, max_new_tokens: int) -> list[int]:
        """Greedy answer tokens, never a vision token (an answer is text: a generated ``<|image_pad|>`` would
        have no image behind it)."""
        eos = self.model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        proc = self.model.processor
        vision_ids = [proc.image_token_id, proc.vision_start_token_id, proc.vision_end_token_id]
        video = self.model.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        if isinstance(video, int) and video >= 0:
            vision_ids.append(video)
        generated: list[int] = []
        position = int(self._live_positions.max()) + 1 if self.live_tokens else 0
        for _ in range(max_new_tokens):
            token = int(
                logits.index_fill(0, torch.tensor(vision_ids, device=logits.device), float("-inf")).argmax()
            )
            generated.append(token)
            if token == eos or len(generated) == max_new_tokens:
                break
            ids = torch.tensor([token])
            pos = torch.full((3, 1), position, dtype=torch.long)
            logits = prefill_span(self.model, ids, pos, context=self._cache).logits
            self._live_ids = torch.cat([self._live_ids, ids])
            self._live_positions = torch.cat([self._live_positions, pos], dim=1)
            if self._live_pieces:
                last = self._live_pieces[-1]
                last.token_ids = torch.cat([last.token_ids, ids])
            position += 1
        return generated


def _copy_item(item: dict) -> dict:
    """A copy of a message item that shares nothing mutable (its fields dict included)."""
    copy = dict(item)
    if "fields" in copy:
        copy["fields"] = dict(copy["fields"])
    return copy


@dataclass
class _Plan:
    """How the prompt tokens after the kept prefix get their KV (prompt indices throughout)."""

    splices: list[tuple[int, KVSegment]] = field(default_factory=list)  # (first index, cached segment)
    computed: list[tuple[int, int]] = field(default_factory=list)  # (first index, length) runs to compute
    features: list[ImageFeatures] = field(
        default_factory=list
    )  # vision outputs of the computed pads, in order
    to_store: list[tuple[int, int, _Image]] = field(default_factory=list)  # images to store once computed

    def splice(self, start: int, segment: KVSegment) -> None:
        """Take ``segment`` for the tokens from ``start``."""
        self.splices.append((start, segment))

    def compute(self, start: int, length: int) -> None:
        """Compute ``length`` tokens from ``start`` (merged with the previous run when adjacent)."""
        if self.computed and sum(self.computed[-1]) == start:
            self.computed[-1] = (self.computed[-1][0], self.computed[-1][1] + length)
        else:
            self.computed.append((start, length))
