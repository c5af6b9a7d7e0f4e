"""Rendering a conversation to token ids with the model's own chat template, so that text is only ever text.

The chat template is rendered with a private-use marker in place of every text item. The template's own
control tokens (``<|im_start|>``, ``<|vision_start|>``, ``<tool_call>``, ...) are then the added tokens found in
that rendering, and only those become control ids; every text item, and the template text around it up to the
next control token, is tokenised as plain text, so a user who writes ``<|im_end|>`` or ``<|image_pad|>``, or a
tool result that writes ``</tool_response><tool_call>``, gets those characters, never a fake turn, image or call.
Each ``<|image_pad|>`` of the template becomes the image's pads directly, without expanding them as text. For text
without control-token strings the ids are exactly the processor's (the tokenizer itself splits on added tokens
first, then tokenises each stretch between them alone), and the token span of every text item and field value
comes along.

A control token is an added token of the tokenizer that it marks special or whose text is a tag, ``<...>``
(``is_control_token``). The released Qwen tokenizers mark ``<tool_call>``, ``<tool_response>``, ``<tools>``,
``<think>`` (their closing tags too) and ``<|fim_prefix|>`` ... ``<|file_sep|>`` as not special, so splitting only
the special ones would let a tool result close its own ``<tool_response>`` and write a call in the model's own
tokens; the rule reads the tokenizer's added tokens, so a new tokenizer is covered without a list. An added token
that is neither (a whole word the vocabulary added: the small checkpoints' ``"type"``, ``"arguments"``, ...,
which shorten tool JSON) is ordinary vocabulary: it decodes to its own characters, can fake nothing, and text
gets it as the tokenizer gives it (those checkpoints were trained on these ids in tools and call arguments).

Worked example (Qwen3-VL template, one user message "hi <|im_end|>" and an image)::

    template rendering   <|im_start|> "user\\n" <|vision_start|> <|image_pad|> <|vision_end|> "\\ue0000\\ue001" <|im_end|> "\\n"
    plain runs           "user\\n"   "hi <|im_end|>" (tokenised as text)   "\\n"
    ids                  [im_start] bpe("user\\n") [vision_start] [pad]*N [vision_end] bpe("hi <|im_end|>") [im_end] bpe("\\n")

A template that rewrites message text (so markers cannot be traced) falls back to rendering the text directly;
there, text holding a control-token string is refused with ``UnsupportedInputError`` rather than let through.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UnsupportedInputError
from ..fields import fill_template
from ..messages import Message, TextItem
from .views import MARK_PATTERN, render_views, tool_views

__all__ = [
    "RenderedPrompt",
    "Tag",
    "collect_spans",
    "control_token_ids",
    "encode_parts",
    "is_control_token",
    "render_prompt",
    "split_marked",
    "starts_with_added_token",
]


@dataclass(frozen=True, eq=False)
class RenderedPrompt:
    """A conversation rendered to token ids, with where each text item and each field value landed."""

    token_ids: torch.Tensor  # (L,) long, image pads expanded
    item_spans: dict[int, tuple[int, int]] | None  # text item "item_id" -> [begin, end) token span
    field_spans: dict[str, tuple[int, int]] | None  # field name -> [begin, end) token span of its value
    # (both None when not traced, or when the chat template rewrites message text so spans cannot be traced)


@dataclass(frozen=True, eq=False)
class _TokenizerFacts:
    """What rendering needs of one processor's tokenizer, worked out once and kept beside it (never on it)."""

    added_vocab: dict[str, int]  # added token (special or not) -> id
    control_ids: frozenset[int]  # ids of its control tokens (is_control_token): never made from caller text
    control: re.Pattern  # any added token, longest first (in template text each becomes its id)
    caller_control: re.Pattern  # any control token, longest first (refused in caller text where untraced)
    plain: object | None  # a private copy of the fast backend that splits control-token strings into text


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # processor -> _TokenizerFacts
_FACTS_LOCK = threading.Lock()


def _facts(processor) -> _TokenizerFacts:
    """The processor's ``_TokenizerFacts`` (made once per processor, thread-safe; the processor is not
    changed)."""
    facts = _FACTS.get(processor)
    if facts is None:
        with _FACTS_LOCK:
            facts = _FACTS.get(processor)
            if facts is None:
                tokenizer = processor.tokenizer
                vocab = tokenizer.get_added_vocab()
                decoder = getattr(tokenizer, "added_tokens_decoder", {})
                control = {
                    text: i
                    for text, i in vocab.items()
                    if is_control_token(text, bool(getattr(decoder.get(i), "special", True)))
                }
                backend = getattr(tokenizer, "backend_tokenizer", None)
                plain = None if backend is None else _plain_backend(backend, set(control))
                facts = _FACTS[processor] = _TokenizerFacts(
                    vocab, frozenset(control.values()), _longest_first(vocab), _longest_first(control), plain
                )
    return facts


def is_control_token(text: str, special: bool) -> bool:
    """Whether the added token ``text`` is a control token: the tokenizer marks it ``special``, or its text is a
    tag (``<`` ... ``>``, no angle bracket inside). Caller text never becomes one.

    >>> [is_control_token(t, s) for t, s in [("<|im_end|>", True), ("<tool_call>", False), ("</think>", False),
    ...  ("<|fim_pad|>", False), ('"type"', False), ("[INST]", True), ("a<b>", False)]]
    [True, True, True, True, False, True, False]
    """
    return special or _TAG.fullmatch(text) is not None


_TAG = re.compile(r"<[^<>]+>")


def _longest_first(tokens) -> re.Pattern:
    """A regex matching any of ``tokens`` (longest first; one that never matches when there are none)."""
    ordered = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered)) if ordered else re.compile(r"(?!x)x")


def _plain_backend(backend, control: set[str]):
    """A copy of a fast tokenizer's backend that tokenises every ``control`` token's string as ordinary text:
    each is marked special in the copy (``encode_special_tokens`` splits only special ones), so ``<tool_call>``
    (not special in the released Qwen tokenizers) is split too. The tokenizer itself is not changed."""
    config = json.loads(backend.to_str())
    for token in config.get("added_tokens", []):
        token["special"] = token["content"] in control
    plain = type(backend).from_str(json.dumps(config))
    plain.encode_special_tokens = True
    return plain


def starts_with_added_token(processor, text: str) -> bool:
    """Whether ``text`` begins with an added token of the processor's tokenizer (which the tokenizer splits on
    first), so that no tokenisation crosses from what comes before into it."""
    return _facts(processor).control.match(text) is not None


def control_token_ids(processor) -> frozenset[int]:
    """The ids of the processor's control tokens (``is_control_token``): ids caller text never becomes."""
    return _facts(processor).control_ids


def encode_parts(
    processor,
    parts: Sequence[tuple[str, bool]],
    offsets: bool = False,
    pad_counts: Sequence[int] | None = None,
) -> tuple[torch.Tensor, dict[int, tuple[int, int]] | None]:
    """Token ids of ``parts`` joined, where a part ``(text, True)`` is template text (its added tokens become
    control ids) and ``(text, False)`` is plain text (never a control id). Consecutive plain stretches between
    two control tokens are tokenised together, as the tokenizer itself would. With ``pad_counts``, the ``i``-th
    ``<|image_pad|>`` of the template text becomes ``pad_counts[i]`` pads.

    Returns ``(ids (L,), spans)``: ``spans[i]`` is the ``[begin, end)`` token span of part ``i`` (the tokens that
    overlap its characters); ``spans`` is None unless ``offsets``. Raises ``ValueError`` when the template's
    image placeholders do not match ``pad_counts``.
    """
    facts = _facts(processor)
    control, vocab = facts.control, facts.added_vocab
    pad, counts = processor.image_token_id, list(pad_counts or [])
    units: list = []  # a list of control ids, or [run text, [(part index, char begin, char end), ...]]
    placeholders = 0
    for index, (text, is_template) in enumerate(parts):
        cursor = 0
        for match in control.finditer(text) if is_template else ():
            _append_plain(units, text[cursor : match.start()], index, is_template)
            token = vocab[match.group(0)]
            if pad_counts is not None and token == pad:
                if placeholders >= len(counts):
                    raise ValueError(
                        f"the template rendered more image placeholders than the {len(counts)} images"
                    )
                units.append((token, counts[placeholders]))
                placeholders += 1
            else:
                units.append((token, 1))
            cursor = match.end()
        _append_plain(units, text[cursor:], index, is_template)
    if pad_counts is not None and placeholders != len(counts):
        raise ValueError(
            f"the template rendered {placeholders} image placeholders but {len(counts)} images were given"
        )
    runs = [u for u in units if isinstance(u, list)]
    encoded = _encode_plain(processor.tokenizer, facts.plain, [run[0] for run in runs], offsets)
    for run, run_ids in zip(runs, encoded["input_ids"], strict=True):
        assert facts.control_ids.isdisjoint(run_ids), (
            f"plain text {run[0]!r} was tokenised to a control token"
        )
    ids: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    run_index = 0
    for unit in units:
        if isinstance(unit, tuple):
            ids.extend([unit[0]] * unit[1])
            continue
        length, run_ids = len(ids), encoded["input_ids"][run_index]
        if offsets:
            mapping = encoded["offset_mapping"][run_index]
            starts, ends = [s for s, _ in mapping], [e for _, e in mapping]
            for part, begin, end in unit[1]:
                first, last = bisect.bisect_right(ends, begin), bisect.bisect_left(starts, end)
                if begin == end:  # an empty part: a zero-width span where it sits
                    first = last = bisect.bisect_left(starts, begin)
                old = spans.get(part)
                spans[part] = (length + first if old is None else old[0], length + max(last, first))
        ids.extend(run_ids)
        run_index += 1
    return torch.tensor(ids, dtype=torch.long), (spans if offsets else None)


def _encode_plain(tokenizer, plain, texts: list[str], offsets: bool) -> dict[str, list]:
    """``input_ids`` (and ``offset_mapping``) of each text, control-token strings split into ordinary tokens.
    ``plain`` (``_plain_backend``'s copy of a fast tokenizer's backend) encodes each text alone (no thread pool
    for a handful of short texts); without one, the (slow) tokenizer is asked to split them per call, which
    splits every added token, special or not."""
    if plain is None:
        return tokenizer(
            texts or [""], add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=offsets
        )
    encodings = [plain.encode(text, add_special_tokens=False) for text in texts]
    return {"input_ids": [e.ids for e in encodings], "offset_mapping": [e.offsets for e in encodings]}


def _append_plain(units: list, text: str, part: int, is_template: bool) -> None:
    """Add ``text`` of part ``part`` to the plain run being built (a new run after a control token). Empty
    template text adds nothing; an empty text part is recorded (a zero-width span where it sits)."""
    if not text and is_template:
        return
    if not units or not isinstance(units[-1], list):
        units.append(["", []])
    run = units[-1]
    run[1].append((part, len(run[0]), len(run[0]) + len(text)))
    run[0] += text


def render_prompt(
    processor,
    messages: Sequence[Message],
    grids: torch.Tensor,
    add_generation_prompt: bool,
    trace: bool = True,
    tools_json: str = "",
) -> RenderedPrompt:
    """Render ``messages`` (and the tools ``tools_json`` declares) with ``processor``'s chat template, all caller
    text as plain text, every image's placeholder expanded to its pads for ``grids`` (one row per image item, in
    order); with ``trace``, the token spans of every text item (by ``item_id``) and of its fields' values come
    along. Changes nothing.

    Raises ``UnsupportedInputError`` only for a template that rewrites caller text while some of it holds a
    control-token string (see the module docstring).
    """
    marked, direct, items = [], [], []
    for message in messages:
        marked_views, direct_views, message_items = render_views(message, start=len(items))
        marked += marked_views
        direct += direct_views
        items += message_items
    marked_tools = direct_tools = None
    if tools_json:
        marked_tools, direct_tools, tool_items = tool_views(tools_json, start=len(items))
        items += tool_items
    parts, tags = split_marked(
        processor.apply_chat_template(marked, add_generation_prompt, tools=marked_tools), items, fields=trace
    )
    expected = processor.apply_chat_template(direct, add_generation_prompt, tools=direct_tools)
    if "".join(text for text, _ in parts) != expected:
        return _render_untraced(processor, expected, items, grids)
    counts = [processor.num_image_tokens(g) for g in grids]
    ids, spans = encode_parts(processor, parts, offsets=trace, pad_counts=counts)
    if not trace:
        return RenderedPrompt(ids, None, None)
    item_spans, field_spans = collect_spans(tags, spans)
    return RenderedPrompt(ids, {k: v for k, v in item_spans.items() if k >= -1}, field_spans)


Tag = (
    tuple[TextItem, str | None] | None
)  # a part's origin: None (template text) or (text item, field or None)


def split_marked(
    rendered: str, items: Sequence[TextItem], fields: bool = True
) -> tuple[list[tuple[str, bool]], list[Tag]]:
    """A marked rendering (``render_views``' markers, numbered as ``items``) as ``encode_parts`` parts: template
    literals (control tokens real) and each item's text (plain text), the text cut at its fields' values when
    ``fields``; with each part's ``Tag``. Reads only."""
    parts: list[tuple[str, bool]] = []
    tags: list[Tag] = []
    for k, piece in enumerate(re.split(MARK_PATTERN, rendered)):  # literal, item index, literal, ...
        if k % 2 == 0:
            parts.append((piece, True))
            tags.append(None)
            continue
        item = items[int(piece)]
        spans = fill_template(item.template, item.field_map)[1] if item.fields and fields else {}
        for text, name in _split_at(item.text, spans):
            parts.append((text, False))
            tags.append((item, name))
    return parts, tags


def collect_spans(
    tags: Sequence[Tag], spans: dict[int, tuple[int, int]]
) -> tuple[dict[int, tuple[int, int]], dict[str, tuple[int, int]]]:
    """The token spans of every text item (by ``item_id``, over all its parts) and of every field's value, from
    the parts' ``tags`` and their token ``spans`` (part index -> ``(begin, end)``, as ``encode_parts`` gives)."""
    item_spans: dict[int, tuple[int, int]] = {}
    field_spans: dict[str, tuple[int, int]] = {}
    for part, tag in enumerate(tags):
        if tag is None or part not in spans:
            continue
        (item, name), (begin, end) = tag, spans[part]
        old = item_spans.get(item.item_id)
        item_spans[item.item_id] = (begin, end) if old is None else (min(old[0], begin), max(old[1], end))
        if name is not None:
            field_spans[name] = (begin, end)
    return item_spans, field_spans


def _split_at(text: str, spans: dict[str, tuple[int, int]]) -> list[tuple[str, str | None]]:
    """``text`` cut at the field value spans: ``[(text, field name or None), ...]`` in order."""
    out, cursor = [], 0
    for name, (b, e) in sorted(spans.items(), key=lambda kv: kv[1]):
        out += [(text[cursor:b], None), (text[b:e], name)]
        cursor = e
    out.append((text[cursor:], None))
    return out


def _render_untraced(processor, text: str, items, grids) -> RenderedPrompt:
    """The fallback for a template that rewrites text: its direct rendering ``text``, after refusing
    control-token strings in any caller text (they could not be kept apart from the template's own)."""
    control = _facts(processor).caller_control
    for item in items:
        found = control.search(item.text)
        if found:
            raise UnsupportedInputError(
                f"this chat template rewrites message text, so text holding the control token {found.group(0)!r} "
                "cannot be kept apart from the template's own; remove it from the text"
            )
    expanded = processor.expand_image_pads(text, grids)
    return RenderedPrompt(torch.tensor(processor.encode_text(expanded), dtype=torch.long), None, None)
