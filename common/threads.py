"""Torch CPU thread counts per process, chosen from the CPUs the run has.

Every role of a run on one machine (the trainer's ranks, each producer) is its own process with its own torch
thread pools, and torch sizes each pool to every core it sees. Three processes on two cores then run six compute
threads (plus as many inter-op threads) that preempt one another in every GEMM: on the quickstart's tiny model that
oversubscription cost more than the extra threads gave. So each role sets its pools at process start:

    threads = trainer.torch_threads (or rollout.torch_threads for a producer), if > 0
            = $OMP_NUM_THREADS, if set (a user's or a test harness's explicit choice)
            = max(1, CPUs this process may run on // processes of the run), the trainer taking the remainder

where the processes of the run are `trainer.num_ranks + rollout.num_producers` (what `rlbus up` starts; a role
started by hand cannot know better and reads the same config). Inter-op pools get one thread: no role runs
independent ops in parallel, and each extra thread is one more to preempt.

    .venv/bin/python -m pytest -q tests/unit/test_threads.py
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rlbus.threads")


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's or `taskset`'s limit, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def auto_threads(num_processes: int, *, cpus: int, takes_remainder: bool = False) -> int:
    """The share of `cpus` one of `num_processes` processes gets (at least 1); `takes_remainder` adds what the even
    split leaves over (the trainer's rank 0, whose step the run waits for) when there is a CPU for everyone: with
    fewer CPUs than processes every process gets one thread (more would only preempt the others')."""
    num_processes = max(1, num_processes)
    share, rest = divmod(cpus, num_processes)
    return max(1, share + (rest if takes_remainder and share > 0 else 0))


def choose_threads(requested: int, num_processes: int, *, cpus: int | None = None, takes_remainder: bool = False,
                   environ: dict[str, str] | None = None) -> tuple[int, str]:
    """(threads, why) for one process: `requested` if > 0, else $OMP_NUM_THREADS if set, else the auto split."""
    if requested > 0:
        return requested, "configured"
    env = os.environ if environ is None else environ
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    cpus = available_cpus() if cpus is None else cpus
    return auto_threads(num_processes, cpus=cpus, takes_remainder=takes_remainder), \
        f"auto: {cpus} CPU(s) over {max(1, num_processes)} process(es)"


def apply_torch_threads(requested: int, num_processes: int, *, role: str, takes_remainder: bool = False) -> int:
    """Set this process's torch intra-op threads (and one inter-op thread); returns the intra-op count.

    Call at process start, before any torch work: torch allows the inter-op pool to be sized only before its first
    use, and a later call leaves it as it is (logged, not raised: the intra-op count, which matters, is still set).
    """
    import torch

    threads, why = choose_threads(requested, num_processes, takes_remainder=takes_remainder)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the pool already started (torch work ran before this call)
        log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())
    log.info("%s: %d torch thread(s) (%s)", role, threads, why)
    return threads


def lower_priority(nice: int, *, role: str) -> None:
    """Lower this process's CPU priority by `nice` (0: leave it). On CPUs shared with the trainer, whose step the
    run waits for, a producer that keeps ahead has time to spare; niced, it yields the CPU while the trainer's
    update runs instead of taking an equal share of it (docs/benchmarks.md, against TRL)."""
    if nice > 0:
        os.nice(nice)
        log.info("%s: CPU priority lowered by %d (nice %d)", role, nice, os.getpriority(os.PRIO_PROCESS, 0))
