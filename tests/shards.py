"""`make test`: the suite as two pytest processes at once, each with its own nats-servers and local Ray.

    .venv/bin/python tests/shards.py [PYTEST ARGS...]

The system tests (tests/system: whole `rlbus up` runs with faults injected) spend most of their time waiting: on
restart back-offs, ack_wait, heartbeats, elections. Run alone they leave the CPU idle for most of their 18 minutes;
beside the unit and integration tests (which keep it busy) they fill that idle time, and they are themselves run on
a busy machine, as a user's run would be. Each shard's output goes to .pytest-shards/NAME.log; a shard's last lines
are printed when it ends, its whole short summary when it fails. The exit status is the first failing shard's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / ".pytest-shards"
#: name -> test paths. The multi-node tests bind 127.0.0.2/3 and must not run twice at once: they share a shard.
SHARDS = {
    "system": ["tests/system"],
    "unit-integration": ["tests/unit", "tests/integration", "tests/gpu"],
}
NO_TESTS = 5  # pytest's exit status when a selection (-m "not slow") leaves a shard nothing to run


def main(args: list[str]) -> int:
    LOGS.mkdir(exist_ok=True)
    started = time.monotonic()
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    for name, paths in SHARDS.items():
        log = LOGS / f"{name}.log"
        # A temporary directory of its own: pytest prunes all but the newest few of the default ones, and would
        # prune a shard's (or another session's) from under its running tests.
        tmp = Path(tempfile.gettempdir()) / f"rlbus-shard-{name}"
        cmd = [sys.executable, "-m", "pytest", *paths, f"--basetemp={tmp}", *args]
        print(f"[{name}] {' '.join(cmd[1:])} > {log.relative_to(ROOT)}", flush=True)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        procs[name] = (proc, log)
    status = 0
    while procs:
        time.sleep(2.0)
        for name, (proc, log) in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[name]
            ok = code in (0, NO_TESTS)
            lines = log.read_text(errors="replace").splitlines()
            took = time.monotonic() - started
            print(f"\n[{name}] {'passed' if ok else f'FAILED (exit {code})'} after {took / 60:.1f} min", flush=True)
            print("\n".join(_report(lines, whole=not ok)), flush=True)
            if not ok and status == 0:
                status = code
    print(f"\nall shards: {time.monotonic() - started:.0f}s, {'passed' if status == 0 else 'FAILED'}")
    return status


def _report(lines: list[str], whole: bool) -> list[str]:
    """The slowest-durations table and the summary; with `whole`, everything from the first failure on."""
    if whole:
        start = next((i for i, ln in enumerate(lines) if ln.startswith("=") and "FAILURES" in ln), len(lines) - 200)
        return lines[max(start, 0) :]
    start = next((i for i, ln in enumerate(lines) if "slowest" in ln and ln.startswith("=")), len(lines) - 5)
    return lines[max(start, 0) :]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
