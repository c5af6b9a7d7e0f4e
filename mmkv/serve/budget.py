"""Memory for decoding images, shared by every request: ``ByteBudget`` lets decodes run together only while the
bytes they may take fit the budget, so many small files that decode to huge images (an all-zero 16-bit PNG of
8192x8192 px is 170 KiB on the wire and about 1.8 GB at the peak of its decode) cannot exhaust the machine.

``decode_bytes`` is that bound for one encoded image, read off its header without decoding it: pixels x 16
bytes (the 16-bit source, its RGB conversion, the pixel hash and the preprocessing copies; measured peaks stay
under it). A decode that does not fit waits, up to its request's deadline (then ``Timeout``); one that could
never fit is refused (``TooLarge``). Example::

    budget = ByteBudget(1 << 30)
    with budget.hold(decode_bytes(data, max_pixels), deadline):
        record = prepare_image(...)      # at most 1 GiB of decodes in flight, all requests together
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator

from PIL import Image

from .protocol import Timeout, TooLarge

__all__ = ["BYTES_PER_PIXEL", "ByteBudget", "decode_bytes"]

BYTES_PER_PIXEL = (
    16  # an upper bound on the bytes a decode holds per pixel, from the file to the model's input
)


def decode_bytes(data: bytes, max_pixels: int) -> int:
    """The bytes decoding ``data`` may take (its header's pixels x ``BYTES_PER_PIXEL``), or, when the header
    cannot be read or is over ``max_pixels`` (the decode refuses it before decoding), what one pixel takes.
    Reads the header only."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception:  # noqa: BLE001 (unreadable: load_image says why, with the right error)
        return BYTES_PER_PIXEL
    return BYTES_PER_PIXEL * (width * height if width * height <= max_pixels else 1)


class ByteBudget:
    """A number of bytes shared by concurrent holders (thread-safe); holders wait in no particular order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._free = threading.Condition()

    @contextlib.contextmanager
    def hold(self, amount: int, deadline: float | None = None) -> Iterator[None]:
        """Hold ``amount`` bytes for the block: waits until they fit (up to ``deadline``, a
        ``time.monotonic()`` time: then ``Timeout``); ``TooLarge`` when they could never fit."""
        if amount > self.capacity:
            raise TooLarge(f"the image needs {amount:,} bytes to decode, over the server's decode budget of "
                           f"{self.capacity:,} (--decode-budget-bytes)", "messages")  # fmt: skip
        with self._free:
            while self.in_use + amount > self.capacity:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise Timeout("the request timed out waiting for memory to decode its images")
                self._free.wait(left)
            self.in_use += amount
        try:
            yield
        finally:
            with self._free:
                self.in_use -= amount
                self._free.notify_all()
