"""The image-decode budget: ByteBudget never lets its holders together exceed it, waits no longer than a deadline
and refuses what could never fit; decode_bytes reads the bound off an image's header alone, for every format."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest
from PIL import Image

from mmkv.serve.budget import BYTES_PER_PIXEL, ByteBudget, decode_bytes
from mmkv.serve.protocol import Timeout, TooLarge


def test_the_decode_budget_holds_across_threads_and_refuses_what_never_fits():
    """ByteBudget: eight threads holding random amounts never hold more than the capacity together; a wait past
    its deadline is a Timeout; an amount over the capacity is TooLarge at once."""
    budget, peak, lock = ByteBudget(100), [0], threading.Lock()

    def worker(amounts):
        for amount in amounts:
            with budget.hold(amount):
                with lock:
                    peak[0] = max(peak[0], budget.in_use)
                time.sleep(0)

    rng = np.random.default_rng(1)
    threads = [threading.Thread(target=worker, args=(rng.integers(1, 100, 50).tolist(),)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 0 < peak[0] <= 100 and budget.in_use == 0
    with budget.hold(60):
        with pytest.raises(Timeout):
            with budget.hold(60, deadline=time.monotonic()):
                pass
    with pytest.raises(TooLarge):
        with budget.hold(101):
            pass
    assert budget.in_use == 0  # the refusals held nothing


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
@pytest.mark.parametrize("size", [(1, 1), (40, 30), (301, 7)])
def test_decode_bytes_is_the_header_s_pixels_times_the_bound_per_pixel(fmt, size):
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, fmt)
    assert decode_bytes(buffer.getvalue(), 10**6) == size[0] * size[1] * BYTES_PER_PIXEL


def test_decode_bytes_of_what_the_decode_refuses_is_one_pixel():
    """Unreadable bytes, a truncated header and an image over ``max_pixels`` (refused before decoding) each count
    as one pixel: the decode's own refusal says why, holding nothing."""
    buffer = io.BytesIO()
    Image.new("RGB", (100, 100)).save(buffer, "PNG")
    png = buffer.getvalue()
    for data, max_pixels in ((b"not an image", 10**6), (png[:20], 10**6), (png, 100 * 100 - 1), (b"", 10**6)):
        assert decode_bytes(data, max_pixels) == BYTES_PER_PIXEL
    assert decode_bytes(png, 100 * 100) == 100 * 100 * BYTES_PER_PIXEL
