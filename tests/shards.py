"""`make test`: the suite as two pytest processes at once, each with its own nats-servers and local Ray.

    .venv/bin/python tests/shards.py [--fast] [PYTEST ARGS...]

The system tests (tests/system: whole `rlbus up` runs with faults injected) spend most of their time waiting: on
restart back-offs, ack_wait, heartbeats, elections. Run alone they leave the CPU idle for most of their 20 minutes;
beside the unit and integration tests (which keep it busy) they fill that idle time, and they are themselves run on
a busy machine, as a user's run would be. Measured on 2 cores: 32.6 minutes for one pytest process, 22.8 for two
shards at once (15.3 and 22.7, the vLLM system tests then in the second shard), when the suite was smaller. A
third shard (the integration tests apart from the unit and FSDP ones) made it slower, 37 minutes against 31 for
two, with the CPU busy 94% of the time: two shards already fill two cores. The run ends with that share (from
/proc/stat): near 100% says only less work makes the suite faster. Each shard's output goes to
.pytest-shards/NAME.log; a shard's last lines are printed when it ends, its whole short summary when it fails. The
exit status is the first failing shard's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / ".pytest-shards"
#: The system test that keeps the CPU busiest (a real model, trained and evaluated) goes with the unit and
#: integration tests, so that the two shards take about as long. name -> pytest arguments.
_BUSY_SYSTEM = ["tests/system/test_real_model.py"]
#: The multi-node tests bind 127.0.0.2/3 and must not run twice at once: they share a shard.
SHARDS = {
    "system": ["tests/system", *(f"--ignore={path}" for path in _BUSY_SYSTEM)],
    "unit-integration": ["tests/unit", "tests/integration", "tests/gpu", *_BUSY_SYSTEM],
}
#: `make test-fast` (--fast): the tests not marked slow (no system test is left unmarked). The unit tests take under
#: a minute; the FSDP2 integration tests (CPU-bound, spawned gloo ranks) go beside them, the rest of the integration
#: tests (real servers, much of it waiting) in the other shard.
_FSDP = [f"tests/integration/{name}.py" for name in
         ("test_fsdp", "test_shared_critic", "test_critic", "test_mixed_precision", "test_safe_loading", "test_lora",
          "test_token_batches", "test_overlong_engine", "test_sft")]
FAST_SHARDS = {
    "unit+fsdp": ["tests/unit", "tests/gpu", *_FSDP, "-m", "not slow"],
    "integration": ["tests/integration", *(f"--ignore={path}" for path in _FSDP), "-m", "not slow"],
}
NO_TESTS = 5  # pytest's exit status when a selection (-m "not slow") leaves a shard nothing to run


def _environ() -> dict[str, str]:
    """The shards' environment: torch's OpenMP threads wait asleep, as in every `rlbus` command (cli/__init__.py).
    Two shards share two cores, and each test process (and each role it starts) has its own threads: spinning ones
    would burn the time slices of the other shard's."""
    env = os.environ.copy()
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def main(args: list[str]) -> int:
    shards = SHARDS
    if args[:1] == ["--fast"]:
        shards, args = FAST_SHARDS, args[1:]
    LOGS.mkdir(exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a CI timeout: the finally below stops the shards
    started, cpu_before = time.monotonic(), _cpu_times()
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    failed: list[str] = []
    try:
        for name, shard_args in shards.items():
            # A temporary directory of its own: pytest prunes all but the newest few of the default ones, and would
            # prune a shard's (or another session's) from under its running tests.
            tmp = Path(tempfile.gettempdir()) / f"rlbus-shard-{name}"
            cmd = [sys.executable, "-m", "pytest", *shard_args, f"--basetemp={tmp}", *args]
            print(f"[{name}] {' '.join(cmd[1:])} > {(LOGS / name).relative_to(ROOT)}.log", flush=True)
            with open(LOGS / f"{name}.log", "w") as out:
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_environ())
            procs[name] = (proc, LOGS / f"{name}.log")
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
                if not ok:
                    status = status or code
                    failed += [f"[{name}] {ln}" for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    finally:
        for proc, _log in procs.values():
            proc.terminate()
    busy = _busy_share(cpu_before, _cpu_times())
    print("\n".join(["", *failed, f"all shards: {time.monotonic() - started:.0f}s, CPU busy {busy:.0%}, "
                                   f"{'FAILED' if status else 'passed'}"]))
    return status


def _cpu_times() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU since boot (/proc/stat's first line; idle and iowait are not busy)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - fields[3] - fields[4], total


def _busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    ticks = after[1] - before[1]
    return (after[0] - before[0]) / ticks if ticks > 0 else float("nan")


def _report(lines: list[str], whole: bool) -> list[str]:
    """The slowest-durations table and the summary; with `whole`, everything from the first failure on."""
    if whole:
        start = next((i for i, ln in enumerate(lines) if ln.startswith("=") and "FAILURES" in ln), len(lines) - 200)
        return lines[max(start, 0) :]
    start = next((i for i, ln in enumerate(lines) if "slowest" in ln and ln.startswith("=")), len(lines) - 5)
    return lines[max(start, 0) :]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
