"""Child processes that must not outlive the process that started them (the embedded nats-server, a Ray head).

    subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent)

Their own session keeps a terminal's Ctrl-C away from them (the starter stops them in order); PR_SET_PDEATHSIG makes
the kernel SIGTERM them if the starter dies without doing so (a SIGKILLed `rlbus up`), so no server is left holding
the run's store or ports.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the thread that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
