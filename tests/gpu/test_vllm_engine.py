"""Runs tests/gpu/check_vllm.py (the vLLM engine end to end) when a CUDA GPU and vLLM are present; skips otherwise.

    .venv/bin/python -m pytest -q tests/gpu/test_vllm_engine.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.check_vllm import skip_reason

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_engine_end_to_end():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    # A fresh process: vLLM owns CUDA state and should not share it with the test runner.
    proc = subprocess.run([sys.executable, str(ROOT / "tests/gpu/check_vllm.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "PASSED" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
