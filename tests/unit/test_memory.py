"""The per-step peak resident memory (`perf/peak_rss_gb`) sees an allocation and forgets it after a reset.

    .venv/bin/python -m pytest -q tests/unit/test_memory.py
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from rlbus.trainer.memory import peak_rss_bytes, reset_peak_rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-step peaks need Linux's clear_refs")
def test_peak_follows_an_allocation_and_resets() -> None:
    assert reset_peak_rss()
    before = peak_rss_bytes()
    block = np.ones(256 * 1024**2 // 8)  # 256 MiB, touched
    during = peak_rss_bytes()
    del block
    assert during - before > 200 * 1024**2
    assert peak_rss_bytes() > during - 16 * 1024**2  # a peak (the block is gone), not the current size
    assert reset_peak_rss()
    assert peak_rss_bytes() < during - 200 * 1024**2
