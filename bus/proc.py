"""Child processes that must not outlive the process that started them (the embedded nats-server, a Ray head).

    subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent)

Their own session keeps a terminal's Ctrl-C away from them (the starter stops them in order); PR_SET_PDEATHSIG makes
the kernel SIGTERM them if the starter dies without doing so (a SIGKILLed `rlbus up`), so no server is left holding
the run's store or ports.

`descendants` and `command_line` find a run's processes from outside (fault tests, bench/soak.py): the roles of
`rlbus up` are grandchildren of it (forked by its fork server, cli/preload.py) whose title is their command line;
`state` tells a running process from a stopped one, a zombie or one that is gone.
"""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the thread that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def descendants(pid: int) -> list[int]:
    """The pids of `pid`'s children, their children, and so on (Linux /proc); [] once it has exited."""
    out: list[int] = []
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:  # exited meanwhile
                continue
            out += kids
            todo += kids
    return out


def command_line(pid: int) -> list[str]:
    """A process's command line as words: its argv, or the title a role forked by `rlbus up` sets (the same command,
    one string: words are split at whitespace); [] once it has exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
    except FileNotFoundError:
        return []


def state(pid: int, thread: int | None = None) -> str:
    """The state letter /proc shows for `pid` (or for one `thread` of it): R running, S sleeping, T stopped, Z a zombie
    not yet reaped, ...; "gone" once it has exited."""
    path = Path(f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat")
    try:
        return path.read_text().rsplit(")", 1)[1].split()[0]  # after the command name, which may hold ") "
    except FileNotFoundError:
        return "gone"
