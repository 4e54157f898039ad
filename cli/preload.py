"""Role processes forked from one process that imported their modules once (`launcher.preload`, on by default).

Importing torch, transformers, FSDP2 and Ray costs a role 4-6 CPU-seconds. On a 2-core machine, a trainer and two
producers importing them at once were most of `rlbus up`'s start-up (docs/benchmarks.md). With `launcher.preload`,
the launcher starts a multiprocessing fork server that imports the role modules the run needs, while the bus and
the Ray head start; each role is then forked from it with those modules imported (their pages shared
copy-on-write with the server) and runs `rlbus.cli.main.main([ROLE, CONFIG, ...])`, the code a
`python -m rlbus.cli ROLE CONFIG ...` process runs.

A forked role is still its own OS process: its own pid (which the launcher supervises, restarts and signals), its
own session, its output in its own log file, the environment the launcher gives it, its command line as `ps` shows
it (the `python -m rlbus.cli ROLE ...` that would start it by hand), and SIGTERM from the kernel when its parent
dies. Its parent is the fork server, which exits when the launcher does (a SIGKILLed launcher
included), so roles still do not outlive their launcher. The server only imports: it opens no connection and runs
no torch op before it forks, so no thread pool, socket or lock is copied half made into a role (torch makes its
thread pools after the fork; `random` is reseeded by Python at fork; the HF engine seeds its generator itself).
If the server dies, the next start makes a new one (multiprocessing does) and the roles it had forked get SIGTERM:
they stop as on any SIGTERM (the trainer checkpoints, producers give their tasks back) and are restarted.

    server = RoleServer(preload_modules(cfg), entry)  # spawns the server; it imports in the background
    proc = server.start(argv, env, log_path)         # a subprocess.Popen-like handle of the forked role

`entry` is the CLI's `rlbus.cli.main.main`, handed in by the launcher's caller (a function crosses to the server by
its name), so that this module does not import the CLI that imports the launcher that imports it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import setproctitle

from rlbus.bus.proc import die_with_parent
from rlbus.schemas.config import RunConfig

#: What every run's roles import (the trainer, the producer service and the CLI that starts them), and the final
#: model's export, which the launcher forks from the server too.
ROLE_MODULES = ("rlbus.cli.main", "rlbus.trainer.service", "rlbus.trainer.engine", "rlbus.producers.service",
                "rlbus.cli.export")
#: The engine modules worth importing ahead; vLLM is left to the producer (its import sets up CUDA state that a
#: fork would copy).
ENGINE_MODULES = {"hf": "rlbus.producers.engines.hf", "simulated": "rlbus.producers.engines.simulated"}


def preload_modules(cfg: RunConfig) -> list[str]:
    """The modules the fork server imports for a run of `cfg`."""
    modules = list(ROLE_MODULES)
    engine = cfg.rollout.engine.__struct_config__.tag  # the config's `type:`
    if engine in ENGINE_MODULES:
        modules.append(ENGINE_MODULES[engine])
    if cfg.eval.interval > 0:
        modules.append("rlbus.producers.evaluator")
    return modules


class ForkedRole:
    """What the launcher uses of subprocess.Popen, for a role forked by the server (which is its parent: the exit
    status reaches us through multiprocessing's sentinel pipe)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self._process = process
        self.pid: int = process.pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:  # still running: the pid is our role's, not reused
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RoleServer:
    """The fork server of one launcher. Construct it once the environment the roles share is set (a Ray head's
    env, read by Ray when it is imported): the server imports with the environment it was started with."""

    def __init__(self, modules: list[str], entry: Callable[[list[str]], int]):
        self._entry = entry  # `rlbus.cli.main.main`: what `python -m rlbus.cli ARGV` runs
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(modules)
        multiprocessing.forkserver.ensure_running()  # spawned now; it imports while the rest starts

    def start(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedRole:
        """Fork `rlbus ARGV` (argv as for `python -m rlbus.cli`, without the interpreter: [ROLE, CONFIG, ...]) with
        `env` as its whole environment and its stdout and stderr appended to `log_path`. The first start waits
        until the server has imported its modules."""
        process = self._ctx.Process(target=_role_main, args=(self._entry, argv, env, str(log_path)),
                                    name=argv[0])
        process.start()
        return ForkedRole(process, ["rlbus", *argv])


def _role_main(entry: Callable[[list[str]], int], argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked role: become what `python -m rlbus.cli ARGV` would be, then run it."""
    # `ps` and /proc/PID/cmdline show the command that starts the same role by hand (not the fork server's). First:
    # setproctitle moves the environment out of the way of the title, which it must find where exec put it.
    setproctitle.setproctitle(shlex.join([sys.executable, "-m", "rlbus.cli", *argv]))
    os.setsid()  # its own session: a terminal's Ctrl-C reaches only the launcher, which stops the roles in order
    die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # PYTHONUNBUFFERED, as the launcher asks
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["rlbus", *argv]
    code: int | str | None = 1
    try:
        code = entry(argv)
    except SystemExit as e:
        code = e.code
    finally:
        # A multiprocessing child leaves through os._exit; run what an interpreter runs at its exit (Ray's
        # disconnect, logging's flush, the role's own handlers).
        atexit._run_exitfuncs()
    sys.exit(code)
