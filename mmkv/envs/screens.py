"""The desktop's screens as pictures: a ticket, a dialog over it, the empty queue (256 x 256 px, 64 tokens).

A ticket screen is the suite's panel (``mmkv.synthetic.render_panel``: status badge, form field, three buttons)
with the ticket's number in the title bar, button labels, and the field's text (white on dark when filled). A
dialog darkens the ticket screen and puts a framed box with an OK button over its middle. Every picture of a
ticket shows its number and its style (title colour, offsets), so two tickets never share a picture; pure
functions of their arguments (the same ticket in the same state is the same picture, pixel for pixel).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from ..synthetic import (
    MAX_REDRAWS,
    PANEL_SIZE,
    PanelStyle,
    Split,
    draw_in_split,
    picture_digest,
    picture_split,
    render_panel,
)

__all__ = [
    "TicketLook",
    "dialog_in_split",
    "render_dialog",
    "render_done",
    "render_ticket",
    "ticket_look_in_split",
]

BUTTON_LABELS = ("approve", "submit", "escalate")
DIALOG_FRAME = (40, 80, 220)  # the dialog box's border and its OK button
DONE_MARK = (40, 170, 60)  # the empty queue's check mark


@functools.cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


@dataclass(frozen=True, slots=True)
class TicketLook:
    """What a ticket looks like apart from its state: its number and its panel style."""

    ticket_id: int  # shown in the title bar
    red: bool  # status badge red (else green)
    prefilled: str  # the field's text when the ticket opens ("" for an empty field)
    style: PanelStyle  # layout offsets, colours, highlighted button


def render_ticket(look: TicketLook, field_text: str) -> Image.Image:
    """The ticket screen with ``field_text`` in the form field (dark with white text when non-empty)."""
    image = render_panel("alert" if look.red else "ok", bool(field_text), look.style)
    draw = ImageDraw.Draw(image)
    dx, dy = look.style.dx, look.style.dy
    draw.text((10, 8 + dy // 4), f"Ticket {look.ticket_id}", fill=(255, 255, 255), font=_font(14))
    draw.text((12 + dx, 96 + dy), "note", fill=(60, 60, 60), font=_font(11))
    if field_text:
        draw.text((20 + dx, 120 + dy), field_text, fill=(255, 255, 255), font=_font(14))
    for i, label in enumerate(BUTTON_LABELS):
        draw.text((16 + dx + 76 * i, 196 + dy), label, fill=(20, 20, 20), font=_font(10))
    return image


def render_dialog(message: str, style: PanelStyle) -> Image.Image:
    """A dialog screen: a dimmed backdrop (the app's title bar) and a framed box saying ``message`` with an OK
    button, placed by ``style``."""
    dx, dy = style.dx, style.dy
    shade = tuple(int(0.55 * c) for c in style.background)
    image = Image.new("RGB", (PANEL_SIZE, PANEL_SIZE), shade)
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, PANEL_SIZE, 28 + dy // 2], fill=tuple(int(0.55 * c) for c in style.title))
    draw.rectangle(
        [28 + dx, 68 + dy, 216 + dx, 180 + dy], fill=(255, 255, 255), outline=DIALOG_FRAME, width=5
    )
    draw.text((44 + dx, 88 + dy), message, fill=(20, 20, 20), font=_font(14))
    draw.rectangle([92 + dx, 132 + dy, 152 + dx, 164 + dy], fill=DIALOG_FRAME)
    draw.text((112 + dx, 140 + dy), "OK", fill=(255, 255, 255), font=_font(14))
    return image


def dialog_in_split(message: str, rng: random.Random, split: Split) -> Image.Image:
    """A dialog screen saying ``message`` whose pixel hash lies in ``split``."""
    return draw_in_split(lambda r: render_dialog(message, PanelStyle.draw(r)), rng, split)


def render_done(rng: random.Random, split: Split) -> Image.Image:
    """The empty queue: a title bar and a large check mark, drawn (style from ``rng``) in ``split``."""

    def draw_done(r: random.Random) -> Image.Image:
        style = PanelStyle.draw(r)
        image = Image.new("RGB", (PANEL_SIZE, PANEL_SIZE), style.background)
        draw = ImageDraw.Draw(image)
        draw.rectangle([0, 0, PANEL_SIZE, 28 + style.dy // 2], fill=style.title)
        draw.text((10, 8), "Queue empty", fill=(255, 255, 255), font=_font(14))
        x, y = 80 + style.dx, 90 + style.dy
        draw.line([(x, y + 40), (x + 30, y + 70), (x + 90, y)], fill=DONE_MARK, width=14)
        return image

    return draw_in_split(draw_done, rng, split)


def ticket_look_in_split(
    ticket_id: int, red: bool, field_texts: Sequence[str], rng: random.Random, split: Split
) -> TicketLook:
    """A look for this ticket whose screens with each of ``field_texts`` in the field (every state the ticket
    will show) all lie in ``split``; the first text is the field's opening text."""
    for _ in range(MAX_REDRAWS):
        look = TicketLook(ticket_id, red, field_texts[0], PanelStyle.draw(rng))
        if all(picture_split(picture_digest(render_ticket(look, t))) == split for t in field_texts):
            return look
    raise RuntimeError(f"no look of ticket {ticket_id} in split {split!r} after {MAX_REDRAWS} draws")
