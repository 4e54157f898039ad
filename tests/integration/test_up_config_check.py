"""`rlbus up` with a config error refuses at once: exit 2 with the error naming its field, and nothing started.

Issue 56's commands, as the user typed them: before the check, each started the bus, Ray, the producers and the
trainer; the trainer refused the task (exit 2) and was restarted four times before the launcher gave up, with exit
1 after 31-74 s. Run here from an empty directory, so that whatever the run would write (its run directory
runs/quickstart: the bus's store, logs, config.yaml; the model init_if_missing builds under .rlbus/) shows up.

    .venv/bin/python -m pytest -q tests/integration/test_up_config_check.py
"""

from __future__ import annotations

import importlib.util
import resource
import subprocess
import sys
import time

import pytest

from tests.support.runs import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="the reasoning-gym extra")


@pytest.mark.parametrize(("tasks", "error"), [
    ("[{name: no_such_task_xyz}]", "env.tasks[0].name: reasoning-gym has no task 'no_such_task_xyz'"),
    ("[{name: count_bits, config: {max_bits: 5}}]", "env.tasks[0].config.max_bits: count_bits has no setting"),
], ids=["unknown-task", "unknown-setting"])
def test_up_exits_2_at_once_and_starts_nothing(tmp_path, tasks, error):
    argv = [sys.executable, "-m", "rlbus.cli", "up", str(ROOT / "configs" / "quickstart.yaml"),
            "env.type=reasoning_gym", f"env.tasks={tasks}", "rollout.agent_loop=single_turn", "rollout.tools=[]"]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"rlbus: config error: {error}" in proc.stderr
    # Nothing started: no run directory (the bus's store, the roles' logs), no model built; the launcher (which
    # starts the bus and Ray and says so) never ran.
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the refused run wrote something"
    assert "rlbus up run" not in proc.stderr and proc.stdout == ""
    # Importing reasoning-gym is most of it (~4 CPU-s); restarting the trainer took 31-74 s. Wall time is loose
    # (2 shared cores), CPU time is what the command itself spent.
    assert cpu < 15 and wall < 30, (cpu, wall)
