"""Torch CPU thread counts per process, sized to the CPUs it may use and the rlbus processes sharing them.

Every compute process rlbus starts (the trainer's ranks, each producer, the evaluator, the judge, a replay, a model
build) has its own torch thread pools, and torch sizes each pool to every core it sees. Three processes on two cores
then run six compute threads that preempt one another in every GEMM, and OpenMP threads spin while they wait for
each other, so oversubscription costs far more than the 2x of a fair split: two quickstart model builds at once on a
busy 2-core machine took 120 s for 50 warm-start steps against 1.8 s alone. So each process sets its intra-op pool:

    threads = trainer.torch_threads / rollout.torch_threads / judge.torch_threads (or `--threads`), if > 0
            = $OMP_NUM_THREADS, if set (a user's or a test harness's explicit choice)
            = max(1, usable CPUs // rlbus processes sharing them), one process taking the remainder

- usable CPUs: min(the affinity mask's CPUs (`taskset`, a cpuset), ceil(the cgroup's CPU quota)): cgroup v2
  `cpu.max` ("quota period" or "max"), v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, the tightest over the process's
  cgroup (read from /proc/self/cgroup) and its parents; a container's `--cpus=1.5` gives 2.
- rlbus processes sharing them: the live entries of a machine-wide registry, one file per process, on CPUs that
  overlap this one's, whichever run (or clone of rlbus) started them; at least the run's own count as the config
  gives it (`trainer.num_ranks + rollout.num_producers`, +1 for the evaluator and the judge), which covers the
  run's roles that have not registered yet. A process on an explicit count holds that many CPUs; the rest are split
  over the others. The remainder goes to one rank 0 of a trainer (the oldest: the step its run waits for).
- a model build (`rlbus init-model`, model.init_if_missing) takes at most init_model.BUILD_THREADS (2).

The registry is a directory of `<pid>-<start time>.json` files, one per process (the start time from
/proc/<pid>/stat, so a reused pid is a different entry): /dev/shm/rlbus-cpu-<uid> (/tmp/... without /dev/shm), or
$RLBUS_CPU_REGISTRY (a directory; `off`: no registry, the run's own count only). One fixed place, not $TMPDIR or
$XDG_RUNTIME_DIR: those differ between a user's shells, cron jobs and containers, and processes that picked two
places would not see each other; a shared place is used only as this user's private (0700) directory. A process
removes its entry at exit; an entry whose process is gone (killed, crashed, os._exit) is ignored and deleted by the
next reader. Not counted: other programs' load and other users' rlbus processes.

Processes re-check (`refresh`, rate-limited to every REFRESH_EVERY_S): a process started alone shrinks when another
run starts and grows back when it ends, each change logged once at INFO. Torch keeps the count per thread (OpenMP),
so the refresh must run on the thread that computes: the roles' event loops hand their work (generate, train step,
weight loads) to executor threads that refresh before each call (`refresh_executor_threads`); the warm start calls
`refresh()` every step, and every trainer rank before each step (trainer/worker.py). A replay holds the recorded
trainer's count (CPU sums depend on it) and does not refresh.
Inter-op pools get one thread: no role runs independent ops in parallel, and each extra thread is one more to
preempt. Environment variables are left as they are: $OMP_NUM_THREADS set by rlbus would read as an explicit count
in its children, which register themselves instead.

    .venv/bin/python -m pytest -q tests/unit/test_threads.py
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("rlbus.threads")

REGISTRY_ENV = "RLBUS_CPU_REGISTRY"
#: Seconds between two looks at the registry and the cgroup (a look costs well under a millisecond).
REFRESH_EVERY_S = 2.0


# -- usable CPUs ------------------------------------------------------------------------------------------------------


def affinity_cpus() -> frozenset[int]:
    """CPU ids this process may run on (its affinity mask: a container's or `taskset`'s limit, not the machine's)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        return frozenset(range(os.cpu_count() or 1))


def _read_quota(directory: Path) -> float | None:
    """CPUs the cgroup at `directory` may use (v2 cpu.max, else v1 cfs quota / period); None: no limit there."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota == "max" or not quota.lstrip("-").isdigit() or not period.isdigit() or int(quota) <= 0:
        return None  # "max" (v2) and -1 (v1): no quota
    return int(quota) / max(1, int(period))


def cgroup_cpu_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                     root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (1.5 = 150 ms per 100 ms), the tightest over the cgroup and its
    parents; None where none is set or nothing can be read. A path that does not exist under the mount (a container
    without a cgroup namespace sees the host's path but has its own cgroup mounted as the root) falls back to the
    nearest parent that does, ending at the mount's root."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:  # v2 (or the unified half of a hybrid setup)
            mounts = [root, root / "unified"]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            mounts = [root / controllers, root / "cpu", root / "cpu,cpuacct"]
        else:
            continue
        for mount in (m for m in mounts if m.is_dir()):
            relative = Path(path.lstrip("/"))
            for directory in [mount / relative, *(mount / p for p in relative.parents)]:
                if (quota := _read_quota(directory)) is not None:
                    limits.append(quota)
            break
    return min(limits) if limits else None


def usable_cpus() -> int:
    """CPUs this process can keep busy: min(its affinity mask, ceil(its cgroup's CPU quota))."""
    cpus = len(affinity_cpus())
    limit = cgroup_cpu_limit()
    return max(1, min(cpus, math.ceil(limit)) if limit is not None else cpus)


# -- the registry of rlbus compute processes -------------------------------------------------------------------------


def process_start(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Start time of process `pid` (clock ticks since boot: with the pid, a name no later process reuses); None if
    no such process runs (or it is a zombie). Without /proc: 0 for a live pid."""
    if not proc.is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # another user's process: alive
            pass
        return 0
    try:
        fields = (proc / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    if not fields or fields[0] in ("Z", "X"):  # exited, not yet reaped: its CPUs are free
        return None
    return int(fields[19])  # field 22 of stat(5), counted from the state (field 3)


@dataclass(frozen=True)
class Entry:
    """One rlbus compute process, as its file says."""

    pid: int
    start: int  # process_start(pid) when it registered
    role: str
    threads: int = 0  # an explicit count it runs on; 0 = auto (a share)
    remainder: bool = False  # may take what the even split leaves (a trainer's rank 0)
    cpus: frozenset[int] = field(default_factory=frozenset)  # its affinity mask; empty = unknown (overlaps all)

    @property
    def name(self) -> str:
        return f"{self.pid}-{self.start}.json"

    def overlaps(self, other: Entry) -> bool:
        return not self.cpus or not other.cpus or bool(self.cpus & other.cpus)


class Registry:
    """A directory of Entry files, one per live rlbus compute process of this user on this machine."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def register(self, entry: Entry) -> None:
        """Write (or rewrite) `entry`'s file; a reader never sees it half written (written aside, then renamed)."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path / f".{entry.name}.tmp"
        tmp.write_text(json.dumps({**asdict(entry), "cpus": sorted(entry.cpus)}))
        os.replace(tmp, self.path / entry.name)

    def unregister(self, entry: Entry) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / entry.name).unlink()

    def live(self) -> list[Entry]:
        """Entries of processes that still run; the files of those gone are deleted."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            pid, _, rest = name.partition("-")
            start = rest.removesuffix(".json")
            if name.startswith(".") or not name.endswith(".json") or not pid.isdigit() or not start.isdigit():
                continue
            if process_start(int(pid)) != int(start):
                with contextlib.suppress(FileNotFoundError):  # another reader may have deleted it first
                    (self.path / name).unlink()
                continue
            try:
                raw = json.loads((self.path / name).read_text())
                out.append(Entry(**{**raw, "cpus": frozenset(raw.get("cpus", ()))}))
            except (OSError, ValueError, TypeError):  # gone since listed, or not ours to read
                continue
        return out


def default_registry(environ: dict[str, str] | None = None) -> Registry | None:
    """The user's registry ($RLBUS_CPU_REGISTRY, else /dev/shm/rlbus-cpu-<uid>); None when `off` or unsafe (a
    directory in a shared /dev/shm or /tmp that is not this user's own, or that others may write)."""
    env = os.environ if environ is None else environ
    chosen = env.get(REGISTRY_ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Registry(Path(chosen))
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = base / f"rlbus-cpu-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        log.warning("no CPU registry at %s (%s): sizing torch threads by this run's processes only", path, e)
        return None
    if path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o022:
        log.warning("%s is not this user's private directory: sizing torch threads by this run's processes only", path)
        return None
    return Registry(path)


# -- the split ------------------------------------------------------------------------------------------------------


def auto_threads(num_processes: int, *, cpus: int, takes_remainder: bool = False) -> int:
    """The share of `cpus` one of `num_processes` processes gets (at least 1); `takes_remainder` adds what the even
    split leaves over when there is a CPU for everyone: with fewer CPUs than processes every process gets one thread
    (more would only preempt the others')."""
    num_processes = max(1, num_processes)
    share, rest = divmod(max(0, cpus), num_processes)
    return max(1, share + (rest if takes_remainder and share > 0 else 0))


def choose_threads(requested: int, num_processes: int, *, cpus: int | None = None, takes_remainder: bool = False,
                   environ: dict[str, str] | None = None) -> tuple[int, str]:
    """(threads, why) for one process without the registry: `requested` if > 0, else $OMP_NUM_THREADS if set, else
    the split of `cpus` (usable_cpus()) over the run's `num_processes`."""
    fixed = _explicit(requested, environ)
    if fixed:
        return fixed
    cpus = usable_cpus() if cpus is None else cpus
    return auto_threads(num_processes, cpus=cpus, takes_remainder=takes_remainder), \
        f"auto: {cpus} CPU(s) over {max(1, num_processes)} process(es)"


def _explicit(requested: int, environ: dict[str, str] | None = None) -> tuple[int, str] | None:
    if requested > 0:
        return requested, "configured"
    omp = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    return None


def share_of(me: Entry, entries: list[Entry], *, cpus: int, num_processes: int = 1) -> tuple[int, str]:
    """(threads, why) of auto process `me` among the live `entries` (itself included or not) on `cpus` usable CPUs:
    the processes on explicit counts hold theirs, the rest is split over the others, counted as at least
    `num_processes` (the run's own); the remainder goes to the oldest process that may take it."""
    others = [e for e in entries if e.name != me.name and e.overlaps(me)]
    fixed = [e for e in others if e.threads > 0]
    held = sum(min(e.threads, cpus) for e in fixed)
    processes = max(num_processes, 1 + len(others))
    elected = me.remainder and not any(e.remainder and (e.start, e.pid) < (me.start, me.pid)
                                       for e in others if e.threads == 0)
    threads = auto_threads(processes - len(fixed), cpus=cpus - held, takes_remainder=elected)
    why = f"auto: {cpus} CPU(s) over {processes} rlbus process(es)"
    if held:
        why += f", {held} held by explicit counts"
    return threads, why


# -- this process's share -------------------------------------------------------------------------------------------


@dataclass
class _Share:
    entry: Entry
    registry: Registry | None
    num_processes: int  # the run's own count (a floor)
    cap: int  # at most this many threads when auto (0: no cap)
    target: int = 0
    why: str = ""
    checked_at: float = 0.0


_share: _Share | None = None
_lock = threading.Lock()
_exit_hook = False


def _decide(s: _Share) -> tuple[int, str]:
    if s.entry.threads > 0:  # held: an explicit count, or a replay's
        return s.target, s.why
    entries = s.registry.live() if s.registry is not None else []
    threads, why = share_of(s.entry, entries, cpus=usable_cpus(), num_processes=s.num_processes)
    if s.cap and threads > s.cap:
        threads, why = s.cap, f"{why}, capped at {s.cap}"
    return threads, why


def _sync(threads: int) -> None:
    """Size the calling thread's pool (torch keeps the count per thread under OpenMP)."""
    import torch

    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _file(s: _Share | None) -> Path | None:
    return None if s is None or s.registry is None else s.registry.path / s.entry.name


def _set_share(s: _Share | None) -> None:
    global _share, _exit_hook
    old, _share = _share, s
    if old is not None and old.registry is not None and _file(old) != _file(s):
        old.registry.unregister(old.entry)  # replaced by nothing, or by an entry elsewhere (a rewrite replaces it)
    if s is not None and s.registry is not None:
        try:
            s.registry.register(s.entry)
        except OSError as e:
            log.warning("%s: not registered in %s (%s)", s.entry.role, s.registry.path, e)
            s.registry = None
    if not _exit_hook:
        atexit.register(release)
        os.register_at_fork(after_in_child=_forget)
        _exit_hook = True


def _forget() -> None:
    """In a forked child: the parent's entry is the parent's (the child registers itself if it computes)."""
    global _share
    _share = None


def release() -> None:
    """Remove this process's entry from the registry and forget its share (at exit; a test between its cases)."""
    s = _share
    if s is not None and s.entry.pid == os.getpid():
        _set_share(None)


def apply_torch_threads(requested: int, num_processes: int, *, role: str, takes_remainder: bool = False,
                        adapt: bool = True, cap: int = 0) -> int:
    """Register this process and set its torch intra-op threads (and one inter-op thread); returns the intra-op count.

    `requested` (> 0) or $OMP_NUM_THREADS is an explicit count, held; otherwise the count follows the registry
    (`refresh`), counting at least the run's `num_processes`. `adapt=False`: the split over `num_processes` alone,
    held (a replay reproduces a recorded trainer). `cap`: at most that many threads when auto.
    Call at process start, before any torch work: torch allows the inter-op pool to be sized only before its first
    use, and a later call leaves it as it is (logged, not raised: the intra-op count, which matters, is still set).
    """
    import torch

    pid = os.getpid()
    held = _explicit(requested)
    if held is None and not adapt:
        held = choose_threads(0, num_processes, takes_remainder=takes_remainder)
    entry = Entry(pid=pid, start=process_start(pid) or 0, role=role, threads=held[0] if held else 0,
                  remainder=takes_remainder and not held, cpus=affinity_cpus())
    s = _Share(entry=entry, registry=default_registry(), num_processes=max(1, num_processes), cap=cap)
    with _lock:
        _set_share(s)
        s.target, s.why = held or _decide(s)
        s.checked_at = time.monotonic()
    _sync(s.target)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the pool already started (torch work ran before this call)
        log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())
    log.info("%s: %d torch thread(s) (%s)", role, s.target, s.why)
    return s.target


def refresh(*, every_s: float = REFRESH_EVERY_S) -> int:
    """Re-check the share (at most every `every_s` seconds) and size the calling thread's pool to it; returns the
    count, or 0 where this process never called apply_torch_threads (nothing is changed then). Cheap enough for
    every step: a clock read and torch.get_num_threads() between looks."""
    s = _share
    if s is None or s.entry.pid != os.getpid():
        return 0
    if s.entry.threads == 0 and time.monotonic() - s.checked_at >= every_s:
        with _lock:
            if time.monotonic() - s.checked_at >= every_s:  # not already done by another thread meanwhile
                threads, why = _decide(s)
                s.checked_at = time.monotonic()
                if threads != s.target:
                    log.info("%s: %d -> %d torch thread(s) (%s)", s.entry.role, s.target, threads, why)
                s.target, s.why = threads, why
    _sync(s.target)
    return s.target


@contextlib.contextmanager
def scoped_torch_threads(requested: int, *, role: str, cap: int = 0) -> Iterator[int]:
    """apply_torch_threads for a stretch of work (a model build, maybe inside a role's or the launcher's process):
    afterwards the process is registered as it was before (or not at all), and the calling thread runs on the
    count it had."""
    import torch

    saved, caller_threads = _share, torch.get_num_threads()
    try:
        yield apply_torch_threads(requested, 1, role=role, cap=cap)
    finally:
        with _lock:
            _set_share(saved if saved is not None and saved.entry.pid == os.getpid() else None)
        torch.set_num_threads(caller_threads)


class _RefreshingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A ThreadPoolExecutor whose threads refresh their torch pool before each call they run."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return super().submit(_refreshed, fn, *args, **kwargs)


def _refreshed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    refresh()
    return fn(*args, **kwargs)


def refresh_executor_threads() -> None:
    """Make the running event loop's default executor (asyncio.to_thread, run_in_executor(None, ...)) refresh the
    torch pool of its thread before each call: a role's compute (a train step, a generate call, a weight load) runs
    there, and torch keeps the count per thread. Call first thing in a role's main coroutine."""
    asyncio.get_running_loop().set_default_executor(_RefreshingExecutor(thread_name_prefix="asyncio"))


def lower_priority(nice: int, *, role: str) -> None:
    """Lower this process's CPU priority by `nice` (0: leave it). On CPUs shared with the trainer, whose step the
    run waits for, a producer that keeps ahead has time to spare; niced, it yields the CPU while the trainer's
    update runs instead of taking an equal share of it (docs/benchmarks.md, against TRL)."""
    if nice > 0:
        os.nice(nice)
        log.info("%s: CPU priority lowered by %d (nice %d)", role, nice, os.getpriority(os.PRIO_PROCESS, 0))
