"""The code sandbox, with real processes: what model-written code can do to itself, and what it cannot do to us.

Each hostile program (fork bomb, endless loop, memory hog, a connection to a server of the test's, a write to a file
of the test's) is stopped with its own status, and the calling process (the producer) is unharmed: its event loop
keeps ticking, its memory does not grow, no process of the run survives it.

    .venv/bin/python -m pytest -q tests/unit/test_sandbox.py
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import psutil
import pytest

from rlbus.producers.sandbox import Sandbox, SandboxLimits
from rlbus.schemas.errors import ConfigError, InfrastructureError
from tests.support.loop_gaps import loop_gaps

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5, memory_bytes=256 << 20, max_processes=8, file_size_bytes=1 << 20,
                       scratch_bytes=4 << 20, max_output_bytes=4096)


@pytest.fixture(scope="module")
async def sandbox() -> AsyncIterator[Sandbox]:
    async with Sandbox(2, limits=LIMITS) as sb:
        await sb.start()
        yield sb


def sandbox_processes(sb: Sandbox) -> int:
    """Processes inside the sandbox's workers, seen from the host (each worker's bwrap holds bwrap + its init)."""
    return sum(len(psutil.Process(pid).children(recursive=True)) for pid in sb.worker_pids())


async def test_ordinary_code_returns_its_output(sandbox: Sandbox) -> None:
    r = await sandbox.run("import sys\nname = input()\nprint(f'hello {name}')\nprint('warn', file=sys.stderr)",
                          stdin="world\n")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "hello world\n", "warn\n")
    assert 0 < r.wall_s < 2


async def test_an_exception_or_an_exit_status_is_an_error(sandbox: Sandbox) -> None:
    r = await sandbox.run("def f(x):\n    return 1 / x\n\nf(0)")
    assert (r.status, r.exit_code) == ("error", 1)
    assert 'File "main.py", line 2, in f' in r.stderr and "return 1 / x" in r.stderr  # the source is shown
    assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert (await sandbox.run("import sys; print('bye'); sys.exit(3)")).exit_code == 3
    r = await sandbox.run("def f(:")
    assert r.status == "error" and "SyntaxError" in r.stderr


async def test_an_endless_loop_is_cut_at_the_wall_clock(sandbox: Sandbox) -> None:
    async with loop_gaps(0.01) as gaps:
        r = await sandbox.run("print('started', flush=True)\nwhile True:\n    pass", timeout_s=1.5)
    assert (r.status, r.exit_code, r.stdout) == ("timeout", -signal.SIGKILL, "started\n")
    assert 1.5 <= r.wall_s < 3.5
    assert max(gaps) < 1.0  # the producer's loop kept running (the run is a process of its own, niced)


async def test_cpu_time_is_limited_per_process() -> None:
    # A wall clock of 30 s, but one CPU second: the kernel stops it (SIGXCPU), not the worker's timer (~1.5 s here;
    # more on a busy machine, where the niced run gets less of a core).
    async with Sandbox(1, limits=SandboxLimits(timeout_s=30.0, cpu_s=1)) as sb:
        r = await sb.run("while True:\n    pass")
    assert (r.status, r.exit_code) == ("timeout", -signal.SIGXCPU)


async def test_a_memory_hog_is_stopped_and_the_producer_keeps_its_memory(sandbox: Sandbox) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    r = await sandbox.run("x = bytearray(1 << 30)")  # one allocation past the 256 MiB limit
    assert r.status == "memory" and r.stderr.rstrip().endswith("MemoryError")
    r = await sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))")  # growing until refused
    assert r.status == "memory"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 << 10  # < 50 MiB more, here
    assert (await sandbox.run("print(len(bytearray(64 << 20)))")).stdout == f"{64 << 20}\n"  # under the limit: fine


async def test_a_fork_bomb_is_held_by_the_process_limit(sandbox: Sandbox) -> None:
    baseline = sandbox_processes(sandbox)
    # The limit itself: children that sleep are forked until the kernel refuses (RLIMIT_NPROC = 8 with this one).
    counting = """import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
except BlockingIOError:
    print(children)
"""
    r = await sandbox.run(counting)
    assert r.status == "ok" and int(r.stdout) == LIMITS.max_processes - 1, r
    # The classic bomb: every process forks forever. Each hits the limit and dies of BlockingIOError, within a second.
    r = await sandbox.run("import os\nwhile True:\n    os.fork()")
    assert r.status == "error" and "BlockingIOError: [Errno 11] Resource temporarily unavailable" in r.stderr
    assert sandbox_processes(sandbox) == baseline  # the sleepers and the bomb's processes are all gone
    assert subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout == "7\n"


async def test_a_bomb_that_survives_the_limit_ends_at_the_wall_clock_without_starving_the_host(
        sandbox: Sandbox) -> None:
    # Every process catches the refusal and forks again: 8 processes spinning on 2 cores until the wall clock. They
    # die together (the pid namespace is emptied), and the producer's loop was served all along (they run at nice 10).
    baseline = sandbox_processes(sandbox)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    async with loop_gaps(0.01) as gaps:
        r = await sandbox.run(bomb, timeout_s=2.0)
    assert r.status == "timeout" and 2.0 <= r.wall_s < 4.0
    assert max(gaps) < 1.0, f"the event loop stalled for {max(gaps):.2f}s"  # (0.05 s on an idle machine)
    assert sandbox_processes(sandbox) == baseline


async def test_processes_left_behind_are_killed_when_the_run_ends(sandbox: Sandbox) -> None:
    baseline = sandbox_processes(sandbox)
    daemon = """import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
os.wait()
print('left a daemon')
"""
    r = await sandbox.run(daemon)
    assert r.stdout == "left a daemon\n"
    assert sandbox_processes(sandbox) == baseline
    # What the next run sees of the sandbox's processes: its worker (pid 1) and itself.
    r = await sandbox.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert eval(r.stdout)[0] == 1 and len(eval(r.stdout)) == 2


async def test_a_run_cannot_kill_its_worker(sandbox: Sandbox) -> None:
    # The worker is pid 1 of the sandbox; as root the run has a uid of its own (without root, init ignores it).
    r = await sandbox.run("import os, signal\nos.kill(1, signal.SIGKILL)")
    assert r.status == "error" and "PermissionError" in r.stderr
    assert (await sandbox.run("print('alive')")).stdout == "alive\n"


async def test_the_network_is_unreachable(sandbox: Sandbox) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # outside: the server answers
            server.accept()[0].close()
        r = await sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                              "print('connected')")
        assert r.status == "error" and "ConnectionRefusedError" in r.stderr and "connected" not in r.stdout
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever reached it
        r = await sandbox.run("import socket\nprint(sorted(name for _, name in socket.if_nameindex()))")
        assert r.stdout == "['lo']\n"  # its own loopback and nothing else
    finally:
        server.close()


async def test_writes_outside_the_scratch_directory_fail(sandbox: Sandbox, tmp_path: Path) -> None:
    target = tmp_path / "owned_by_the_test.txt"
    r = await sandbox.run(f"open({str(target)!r}, 'w').write('pwned')")
    assert r.status == "error" and "FileNotFoundError" in r.stderr  # the host's /tmp is not there at all
    assert not target.exists()
    for path in ("/usr/pwned", "/pwned", "/proc/sys/kernel/hostname"):
        r = await sandbox.run(f"open({path!r}, 'w').write('x')")
        assert r.status == "error" and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr), r
    # Its own directory works (cwd, /tmp and TMPDIR are one tmpfs), and is empty again for the next run.
    r = await sandbox.run("import os, tempfile\nopen('a.txt', 'w').write('1')\n"
                          "tempfile.NamedTemporaryFile(delete=False).write(b'2')\nprint(len(os.listdir('/tmp')))")
    assert r.stdout == "2\n"
    assert (await sandbox.run("import os\nprint(os.listdir('.'))")).stdout == "[]\n"


async def test_file_and_scratch_sizes_are_bounded(sandbox: Sandbox) -> None:
    r = await sandbox.run("open('big', 'wb').write(b'x' * (2 << 20))")  # past file_size_bytes = 1 MiB
    assert r.status == "error" and "File too large" in r.stderr
    fill = "for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * 1000000)"  # 8 MB in a 4 MiB scratch
    r = await sandbox.run(fill)
    assert r.status == "error" and "No space left on device" in r.stderr
    r = await sandbox.run("print('x' * 100000)")  # stdout is kept up to max_output_bytes
    assert r.status == "ok" and r.stdout == "x" * LIMITS.max_output_bytes


async def test_runs_beyond_the_pool_wait_their_turn(sandbox: Sandbox) -> None:
    # 8 runs on 2 workers: never more than 2 at once (their own clocks say so), and the loop is free meanwhile.
    code = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())"
    began = time.monotonic()
    async with loop_gaps(0.01) as gaps:
        results = await asyncio.gather(*(sandbox.run(code) for _ in range(8)))
    assert all(r.status == "ok" for r in results)
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most <= 2  # (2 on an idle machine)
    assert time.monotonic() - began >= 4 * 0.3
    assert max(gaps) < 1.0  # blocked, it would stall for the whole 1.2 s


async def test_a_warm_call_costs_milliseconds(sandbox: Sandbox) -> None:
    costs = []
    for _ in range(20):
        began = time.perf_counter()
        await sandbox.run("print(1)")
        costs.append(time.perf_counter() - began)
    assert statistics.median(costs) < 0.1  # ~3 ms on an idle machine; the bound leaves room for a busy one


async def test_a_missing_bwrap_is_an_infrastructure_error(tmp_path: Path) -> None:
    async with Sandbox(1, bwrap=str(tmp_path / "no-bwrap")) as sb:
        with pytest.raises(InfrastructureError) as err:
            await sb.run("print(1)")
    assert err.value.source == "sandbox" and "bubblewrap" in err.value.reason and "no bwrap at" in err.value.reason


async def test_a_worker_that_cannot_start_is_an_infrastructure_error() -> None:
    async with Sandbox(1, bwrap="/bin/false") as sb:  # runs, prints nothing, exits 1
        with pytest.raises(InfrastructureError, match="a worker did not start: the worker exited"):
            await sb.run("print(1)")


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError) as err:
        SandboxLimits(memory_bytes=0)
    assert err.value.field == "sandbox.memory_bytes"
    with pytest.raises(ConfigError, match="sandbox.max_workers"):
        Sandbox(0)


async def test_a_worker_killed_mid_run_is_an_infrastructure_error_and_is_replaced() -> None:
    # The OOM killer, say, takes the worker itself: the run raises (it is not the code's failure), the next one runs
    # on a fresh worker.
    async with Sandbox(1) as sb:
        await sb.start()
        [pid] = sb.worker_pids()
        run = asyncio.create_task(sb.run("import time\ntime.sleep(5)"))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(InfrastructureError, match="the worker exited"):
            await run
        assert (await sb.run("print('fresh')")).stdout == "fresh\n"
        assert sb.worker_pids() != [pid]


async def test_close_leaves_no_process_behind() -> None:
    sb = Sandbox(2)
    await sb.start()
    pids = sb.worker_pids()
    inside = [c for pid in pids for c in psutil.Process(pid).children(recursive=True)]
    assert len(pids) == 2 and len(inside) >= 2
    await sb.close()
    # Each worker read the end of its input and exited; bwrap reaped it and exited in turn (reaped by close).
    assert not [p.pid for p in inside if p.is_running()] and not [pid for pid in pids if psutil.pid_exists(pid)]
    with pytest.raises(RuntimeError, match="after close"):
        await sb.run("print(1)")
