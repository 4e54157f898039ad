"""The per-step peak resident memory (`perf/peak_rss_gb`) sees an allocation and forgets it after a reset.

    .venv/bin/python -m pytest -q tests/unit/test_memory.py

Measured in a fresh interpreter: inside a long test session the allocator may serve the block from memory that is
already resident, and the peak would not move (seen once in the full suite).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import numpy as np
from rlbus.trainer.memory import peak_rss_bytes, reset_peak_rss
assert reset_peak_rss()
before = peak_rss_bytes()
block = np.ones(256 * 1024**2 // 8)  # 256 MiB, touched
during = peak_rss_bytes()
del block
assert during - before > 200 * 1024**2, (before, during)
assert peak_rss_bytes() > during - 16 * 1024**2  # a peak (the block is gone), not the current size
assert reset_peak_rss()
assert peak_rss_bytes() < during - 200 * 1024**2
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-step peaks need Linux's clear_refs")
def test_peak_follows_an_allocation_and_resets() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
