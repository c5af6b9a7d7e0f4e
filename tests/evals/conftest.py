"""Eval tests run tiny models on one thread: fastest for them, and timings stay sane on a shared CPU."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for the module; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
