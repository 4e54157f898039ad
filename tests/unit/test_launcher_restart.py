"""cli/launcher.py's supervision of a role that exits: restarted when it crashed, never when it refused the config.

A role that exits 2 (`rlbus: config error: ...`, cli/main.py) would refuse the config again however often it was
started: the launcher stops the run with that role's message and exit status 2 instead. Any other exit is a fault
the launcher rides out by starting the role again. The roles here are real processes this test starts (a python
that prints and exits), supervised by the launcher's own code.

    .venv/bin/python -m pytest -q tests/unit/test_launcher_restart.py
"""

from __future__ import annotations

import sys

from rlbus.cli.child import Child
from rlbus.cli.launcher import Launcher
from rlbus.cli.validate import CONFIG_ERROR_EXIT
from rlbus.schemas.config_io import load_config

#: What a role prints when it refuses its config (cli/main.py), then its exit status.
REFUSING = ("import sys\n"
            "print('loading the config', flush=True)\n"
            "print('rlbus: config error: 2 errors:', file=sys.stderr)\n"
            "print('  env.tasks[0].name: reasoning-gym has no task \\'gcdd\\' (did you mean gcd?)', file=sys.stderr)\n"
            "print('  rollout.tools: cannot import module \\'my_tools\\'', file=sys.stderr)\n"
            "print('shutting down', file=sys.stderr)\n"
            "sys.exit(2)\n")


def _exited(tmp_path, name: str, code: str) -> Child:
    child = Child(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")
    child.start()
    child.proc.wait(timeout=60)
    return child


def test_a_role_that_refuses_its_config_stops_the_run_and_one_that_crashed_is_restarted(tmp_path, capsys):
    cfg = load_config(None, ["model.path=m", f"logging.run_dir={tmp_path}"])
    launcher = Launcher(cfg, entry=lambda argv: 0)
    refusing = _exited(tmp_path, "producer-0", REFUSING)
    crashed = _exited(tmp_path, "producer-1", "raise SystemExit(1)")
    refused_pid, crashed_pid = refusing.pid, crashed.pid
    try:
        # Mid-run (the role had got going): the refusal ends the run with 2, the crash is restarted.
        assert launcher._restart_if_dead(refusing, got_going=True) == CONFIG_ERROR_EXIT == 2
        assert refusing.restarts == 0 and refusing.pid == refused_pid and refusing.poll() == 2
        assert launcher._restart_if_dead(crashed, got_going=True) is None
        assert crashed.restarts == 1 and crashed.pid != crashed_pid
    finally:
        crashed.proc.wait(timeout=60)
    err = " ".join(capsys.readouterr().err.split())  # as one line, however the console wrapped it
    assert "producer-0 exited with code 2: it refused the run's config; not restarting it" in err
    # The role's own message, whole (the field's brackets are text, not markup), and not what came after it.
    assert "env.tasks[0].name: reasoning-gym has no task 'gcdd' (did you mean gcd?)" in err
    assert "rollout.tools: cannot import module 'my_tools'" in err and "shutting down" not in err
    assert "producer-1 exited with code 1; restarting" in err


def test_the_config_error_is_read_from_the_roles_log(tmp_path):
    child = _exited(tmp_path, "trainer", REFUSING)
    assert child.config_error().splitlines() == [
        "rlbus: config error: 2 errors:",
        "  env.tasks[0].name: reasoning-gym has no task 'gcdd' (did you mean gcd?)",
        "  rollout.tools: cannot import module 'my_tools'",
    ]
    silent = _exited(tmp_path, "judge", "print('no model'); raise SystemExit(2)")
    assert silent.config_error() == "no model"  # no config error line: the log's tail
