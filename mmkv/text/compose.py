"""Precompiled text: the KV of a reusable text ("skill", policy, long instruction) computed once, in isolation
after a canonical preamble, stored like an image's KV, and spliced into any session at any position.

``precompile(model, text)`` returns a ``TextSegment`` (a ``KVSegment`` that also remembers its text and fields);
``Session.add_segment(segment, seam=k)`` splices it, re-rotated, with its first ``k`` tokens recomputed in the
new context. After the canonical preamble the splice is exact; elsewhere it is the same approximation as a
reused image, and the seam repairs its joint.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dataclass_fields

from ..cache.digest import text_digest
from ..cache.store import KVStore
from ..fields import fill_template, validate_fields
from ..kv.prefill import prefill_span
from ..kv.segment import KVSegment
from ..kv.spans import text_span
from ..messages import check_text
from ..model.handle import ModelHandle
from ..prompt.render import encode_parts

__all__ = ["TextSegment", "canonical_preamble", "precompile"]

_MARK = "\ue000text\ue001"


@dataclass(frozen=True, eq=False)
class TextSegment(KVSegment):
    """The KV of a precompiled text, with what it says: a template and its fields (``{name}`` placeholders)."""

    template: str = ""  # the text, with a {name} placeholder for each field
    fields: tuple[tuple[str, str], ...] = ()  # (name, value) of each field, as compiled
    preamble: str = ""  # the text it was computed after (positions start right after it)

    @property
    def text(self) -> str:
        """The text the segment encodes (fields filled in)."""
        return fill_template(self.template, dict(self.fields))[0]


def canonical_preamble(model: ModelHandle, role: str = "user") -> str:
    """The chat-template text that precedes the first message's text when that message is ``role``'s: e.g.
    ``"<|im_start|>user\\n"`` for Qwen3-VL, the default system prompt and then that for Qwen2.5-VL."""
    messages = [{"role": role, "content": [{"type": "text", "text": _MARK}]}]
    rendered = model.processor.apply_chat_template(messages, add_generation_prompt=False)
    if _MARK not in rendered:
        raise ValueError("the chat template does not render message text verbatim; pass preamble= explicitly")
    return rendered[: rendered.index(_MARK)]


def precompile(
    model: ModelHandle,
    text: str,
    fields: dict[str, str] | None = None,
    *,
    store: KVStore | None = None,
    preamble: str | None = None,
    role: str = "user",
) -> TextSegment:
    """The KV of ``text`` (with ``fields`` filled in, see ``Session.add_text``) computed right after
    ``preamble`` (default: ``canonical_preamble(model, role)``), at the positions that follow it.

    With a ``store`` (the same ``KVStore`` that holds images), the segment is looked up first under a
    digest of its token ids, the preamble and the model fingerprint, and stored after computing.
    Raises ``ValueError`` for empty text or a preamble whose last token would merge with the text.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("precompile needs a non-empty str")
    check_text(text, "text")
    fields = validate_fields(text, fields or {})
    filled, _ = fill_template(text, fields)
    preamble = canonical_preamble(model, role) if preamble is None else preamble
    check_text(preamble, "preamble")
    # the preamble is template text (its control tokens are real), the text is plain text, as a session renders it
    preamble_ids = encode_parts(model.processor, [(preamble, True)])[0].tolist()
    joined = encode_parts(model.processor, [(preamble, True), (filled, False)])[0].tolist()
    if joined[: len(preamble_ids)] != preamble_ids:
        raise ValueError(
            "the preamble's last token merges with the text; end the preamble at a token boundary"
        )
    ids = joined[len(preamble_ids) :]
    digest = text_digest(ids, str(model.fingerprint), context=preamble)
    segment = None if store is None else store.get(digest, model)
    if segment is None:
        context = None
        if preamble_ids:
            token_ids, positions = text_span(preamble_ids, 0)
            context = prefill_span(model, token_ids, positions).cache
        token_ids, positions = text_span(ids, len(preamble_ids))
        segment = prefill_span(
            model, token_ids, positions, context=context, kind="text", digest=digest
        ).segment
        if store is not None:
            store.put(digest, segment, model)
    base = {f.name: getattr(segment, f.name) for f in dataclass_fields(KVSegment)}
    return TextSegment(**base, template=text, fields=tuple(fields.items()), preamble=preamble)
