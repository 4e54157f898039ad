"""Start, join and stop the Ray cluster that carries rlbus's data plane (TransferQueue, weight store).

    from rlbus.bus.ray_cluster import ensure_ray, start_ray_head, stop_ray_head
    head = start_ray_head(num_cpus=4)   # `rlbus up`: a loopback head that outlives any one role process
    ensure_ray(RayConfig(address=head.address))   # every role process, with os.environ updated by head.env
    stop_ray_head(head)

Ray's dashboard, autoscaler monitor, log monitor and Ray Client server are not started (rlbus uses none of them, and
on a small machine their start-up CPU is the roles' start-up time; the client server has no `ray start` switch, and
`--include-dashboard=false` still starts a dashboard process, so heads run `ray start` through bus/ray_start.py). Three more Ray defaults are overridden for the clusters rlbus starts:
- Ray advertises (and binds) the machine's routable IP even for a single-node cluster. Loopback-only is asked for
  here, and Ray's only switch for it is the environment variable `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read when
  `ray` is imported -- so the head runs as a child process with that variable set.
- Token authentication is on, with a fresh random token per head (`ray start --head` would otherwise start without
  it unless a token already exists in ~/.ray/auth_token). Ray's token mode is all environment: `RAY_AUTH_MODE=token`
  turns it on, and every Ray process -- the head's GCS, raylet, agents and workers, and every driver -- finds the
  token in, first to last, `RAY_AUTH_TOKEN` (the token itself), `RAY_AUTH_TOKEN_PATH` (a file holding it),
  `~/.ray/auth_token`. The token is written to a 0600 file in a fresh 0700 directory, and `RayHead.env` carries
  `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH`: the secret itself is in no environment and on no command line.
  Ray caches the mode (and the token) the first time it reads them in a process; `ensure_ray` re-reads both before
  it connects, so a process that imported Ray before it learnt about the head still connects.
  A multi-machine cluster is started by the user with `ray start` (RAY_AUTH_MODE=token and the same token on every
  machine and for every rlbus process) and given as ray.address.
- A node that died is declared dead after about 3 s instead of 15 (NODE_DEATH_ENV: the GCS health-checks each
  raylet every second and gives up after 3 failures in a row, not every 3 s and after 5). Until then Ray keeps the
  node's actors ALIVE: a TransferQueue shard or the weight store that was on it is neither restarted nor reported
  dead, and every call to it waits (the nemesis' shard kills after a node loss stalled 13-21 s). A live raylet
  that is merely slow is not at risk: a check fails only after its own 10 s timeout. Variables the user set win.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.bus.proc import die_with_parent as kill_with_parent
from rlbus.bus.proc import state as proc_state
from rlbus.schemas.config import RayConfig

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: A head's env names the file its starter touches once the head is up (`await_ray_head`); `ensure_ray` waits for it.
UP_ENV, UP_FILE = "RLBUS_RAY_UP", "up"
#: GCS settings (read from the environment by the head's gcs_server) that declare a dead node dead within ~3 s.
NODE_DEATH_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
_STARTED: dict[int, subprocess.Popen] = {}  # heads this process started, by pid, so that stop can reap them


@dataclass(frozen=True)
class RayHead:
    """A Ray head node running as a child process (`ray start --head --block`)."""

    pid: int  # the `ray start --block` process; its process group holds every Ray process it started
    address: str  # GCS address "127.0.0.1:<port>" to hand to ray.init / child processes
    temp_dir: str  # ray-start.log, the token's folder (by default) and Ray's temp dir `ray/` (session files, logs)
    env: dict[str, str] = field(default_factory=dict)  # environment a process needs to connect to this head
    token_path: str = ""  # the head's auth token (0600, in a 0700 directory of its own); "" = token auth off

    def apply_env(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Put what a process needs to join this head into `environ` (default os.environ), for it and its children.

        Also drops an inherited RAY_AUTH_TOKEN: Ray prefers it to RAY_AUTH_TOKEN_PATH, and it would belong to some
        other cluster."""
        environ = os.environ if environ is None else environ
        environ.update(self.env)
        if "RAY_AUTH_TOKEN_PATH" in self.env:
            environ.pop("RAY_AUTH_TOKEN", None)


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free on the loopback interface right now (the OS picks them; never a fixed port). All n
    sockets are held until every port is chosen: asked one at a time, the OS may hand back a port it just released,
    and Ray refuses a start where two of its components got the same one."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    return free_ports(1)[0]


def _ray_start() -> list[str]:
    """Ray's `ray start` CLI under this interpreter (a virtualenv's Ray even when it is not on PATH), without the
    Ray Client server nothing of rlbus uses (bus/ray_start.py)."""
    return [sys.executable, "-m", "rlbus.bus.ray_start", "start"]


def write_token(parent: str | None = None) -> str:
    """Write a fresh random Ray auth token (256 bits, hex, as `ray get-auth-token --generate` makes) to a 0600 file
    in a new 0700 directory under `parent` (default: the system temp dir); return the file's path."""
    if parent:
        os.makedirs(parent, mode=0o700, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="rlbus-ray-auth-", dir=parent)  # 0700, and new: nobody else can have it open
    path = os.path.join(folder, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def start_ray_head(
    num_cpus: int = 0,
    object_store_memory: int = 0,
    temp_dir: str | None = None,
    timeout_s: float = 90.0,
    die_with_parent: bool = True,
    token_dir: str | None = None,
    node_ip: str = LOOPBACK,
    resources: dict[str, float] | None = None,
    wait: bool = True,
) -> RayHead:
    """Start a loopback-only Ray head with token authentication as a child process; wait until it accepts drivers.

    num_cpus / object_store_memory: 0 = Ray's default. die_with_parent: SIGTERM the head when the calling thread
    exits (Linux PR_SET_PDEATHSIG; call it from a thread that lives as long as the cluster should, e.g. the main one).
    token_dir: where the token's private folder is made (e.g. the run directory); default: the head's temp dir.
    node_ip: 127.0.0.1 makes a single-node cluster (Ray's loopback mode); another loopback address (127.0.0.2)
    makes a head that other nodes may join (`start_ray_node`), each on an address of its own, as machines would be.
    Processes join the head with `head.apply_env()` (or head.env in their environment) and `ensure_ray`.
    wait=False: return once the head's processes are spawned (its address is known then); `await_ray_head` waits for
    it, and an `ensure_ray` with head.env waits too, so role processes may start (and import torch) meanwhile.
    """
    # Short path: Ray puts unix sockets under it and their paths are limited to ~107 bytes. Ray makes its own temp
    # dir (and the session, sockets and logs dirs in it) mode 0777, so it gets a subfolder of a private (0700) one:
    # nobody else can read its logs or swap its unix sockets.
    _check_loopback(node_ip)
    root = temp_dir or tempfile.mkdtemp(prefix="rlbus-ray-", dir="/tmp")
    token_path = write_token(token_dir or root)
    head_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path,
                **{k: os.environ.get(k, v) for k, v in NODE_DEATH_ENV.items()}}
    if node_ip == LOOPBACK:  # Ray's only switch for "bind and advertise loopback" (read when ray is imported)
        head_env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Every port of the start in one draw: ports drawn and released in two draws may coincide (a run's Ray start
    # once failed with its GCS and runtime-env agent on the same port).
    port, dashboard_port, *node_ports = free_ports(2 + len(NODE_PORTS))
    cmd = [
        *_ray_start(), "--head", "--block", "--disable-usage-stats",
        f"--node-ip-address={node_ip}", f"--port={port}", "--include-dashboard=false",
        # No autoscaler monitor: a head rlbus starts has no cluster config to scale (its CPU is start-up time).
        "--no-monitor",
        f"--dashboard-port={dashboard_port}",
    ]  # fmt: skip
    head_env[UP_ENV] = os.path.join(root, UP_FILE)
    head = RayHead(pid=0, address=f"{node_ip}:{port}", temp_dir=root, env=head_env, token_path=token_path)
    try:
        pid = _spawn(cmd, head, node_ports, num_cpus, object_store_memory, resources, die_with_parent)
        head = dataclasses.replace(head, pid=pid)
        if wait:
            await_ray_head(head, timeout_s)
    except BaseException:
        shutil.rmtree(Path(token_path).parent, ignore_errors=True)
        raise
    return head


def await_ray_head(head: RayHead, timeout_s: float = 90.0) -> RayHead:
    """Wait until a head (or node) started by this process accepts drivers; then mark it up (UP_ENV's file), for
    the processes that were started before it was and wait in `ensure_ray`. Raises RuntimeError (and stops what
    was started) if it exits or is not up in `timeout_s`."""
    log_path = _start_log(head)
    proc = _STARTED[head.pid]
    deadline = time.monotonic() + timeout_s
    while b"Ray runtime started" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            text = log_path.read_text(errors="replace")[-3000:]
            stop_ray_head(proc.pid)
            reason = f"exited with {proc.returncode}" if proc.returncode is not None else f"not up in {timeout_s}s"
            raise RuntimeError(f"ray start {reason}; log tail:\n{text}")
        time.sleep(0.1)
    if UP_ENV in head.env:
        Path(head.env[UP_ENV]).touch()
    log.info("Ray %s up at %s (pid %d, logs in %s)", "head" if "--head" in proc.args else "node", head.address,
             head.pid, head.temp_dir)
    return head


def _await_marked_up(timeout_s: float = 90.0) -> None:
    """In a process given a head's env before the head was up (`start_ray_head(wait=False)`): wait for its mark."""
    path = os.environ.get(UP_ENV, "")
    if not path or os.path.exists(path):
        return
    log.info("waiting for the Ray head to be up (%s)", path)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head of this run was not up within {timeout_s:.0f} s ({path} never came)")
        time.sleep(0.05)


def start_ray_node(
    head: RayHead,
    node_ip: str,
    num_cpus: int = 0,
    object_store_memory: int = 0,
    resources: dict[str, float] | None = None,
    timeout_s: float = 90.0,
    die_with_parent: bool = True,
) -> RayHead:
    """Join one more node to a multi-node head (`start_ray_head(node_ip="127.0.0.2")`), on its own loopback address,
    as `ray start --address` does on a second machine. Returns its record (stop it with `stop_ray_head`; its
    `address` is the head's GCS address, its `env` the head's). `resources` names it for placement."""
    _check_loopback(node_ip)
    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in head.env:
        raise RuntimeError(f"the head at {head.address} is a single-node (127.0.0.1) cluster; start it on another "
                           "loopback address (node_ip='127.0.0.2') to join nodes to it")
    root = tempfile.mkdtemp(prefix="rlbus-ray-", dir="/tmp")
    cmd = [*_ray_start(), f"--address={head.address}", "--block", "--disable-usage-stats",
           f"--node-ip-address={node_ip}"]
    node = RayHead(pid=0, address=head.address, temp_dir=root, env=dict(head.env), token_path="")
    pid = _spawn(cmd, node, free_ports(len(NODE_PORTS)), num_cpus, object_store_memory, resources, die_with_parent)
    return await_ray_head(dataclasses.replace(node, pid=pid), timeout_s)


def _check_loopback(node_ip: str) -> None:
    if not node_ip.startswith("127."):
        raise ValueError(f"node_ip {node_ip!r}: clusters rlbus starts itself are loopback-only (127.0.0.0/8)")


def _start_log(node: RayHead) -> Path:
    """What `ray start --block` prints (its "Ray runtime started" line is how `await_ray_head` knows it is up)."""
    return Path(node.temp_dir) / "ray-start.log"


#: The listening ports of a node's own components, each given explicitly to `ray start` (`_spawn`).
NODE_PORTS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
              "runtime-env-agent-port", "node-manager-port", "object-manager-port")  # fmt: skip


def _spawn(cmd: list[str], node: RayHead, ports: list[int], num_cpus: int, object_store_memory: int,
           resources: dict[str, float] | None, die_with_parent: bool) -> int:
    """Run one `ray start ... --block` (every listening port explicit: several Ray clusters may share this machine,
    and Ray's defaults are fixed; `ports`: one per NODE_PORTS, drawn with the command's own in one `free_ports`);
    return its pid (`await_ray_head` waits for it to be up)."""
    cmd = [
        *cmd, f"--temp-dir={os.path.join(node.temp_dir, 'ray')}",
        *(f"--{flag}={port}" for flag, port in zip(NODE_PORTS, ports, strict=True)),
        # Every rlbus driver connects with log_to_driver=False: the log monitor would forward worker output that
        # nobody reads (the files stay in the temp dir).
        "--include-log-monitor=false",
    ]  # fmt: skip
    if num_cpus > 0:
        cmd.append(f"--num-cpus={num_cpus}")
    if object_store_memory > 0:
        cmd.append(f"--object-store-memory={object_store_memory}")
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    env = dict(os.environ, **node.env, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_TOKEN", None)  # Ray would prefer it to the file: someone else's token
    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in node.env:
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # inherited from a loopback head would refuse to join
    with open(_start_log(node), "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop_ray_head kills exactly what it started
            # `ray start --block` stops its children on SIGTERM
            preexec_fn=kill_with_parent if die_with_parent else None,
        )
    _STARTED[proc.pid] = proc
    return proc.pid


def head_running(head: RayHead) -> bool:
    """Whether a head (or node) this process started still runs: `ray start --block` exits when a Ray process
    it started dies."""
    return _alive(head.pid)


def _alive(pid: int) -> bool:
    proc = _STARTED.get(pid)
    if proc is not None:
        return proc.poll() is None
    return proc_state(pid) not in ("Z", "gone")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)  # signal 0: only asks whether any process of the group exists
    except ProcessLookupError:
        return False
    return True


def stop_ray_head(head: RayHead | int, timeout_s: float = 5.0, remove_temp_dir: bool = True) -> None:
    """Stop a head started by start_ray_head: SIGTERM its `ray start --block` process (which stops the Ray
    processes it started), then SIGKILL whatever is left in its process group. Touches nothing else.

    The grace is short: whoever stops the head is done with its objects, and `ray start --block` may take half
    a minute to wind down on its own."""
    pid = head.pid if isinstance(head, RayHead) else head
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The group id is the head's pid (start_new_session); workers and agents it spawned stay in that group.
    if _group_alive(pid):
        os.killpg(pid, signal.SIGKILL)
    proc = _STARTED.pop(pid, None)
    if proc is not None:
        proc.wait(timeout=timeout_s)
    if isinstance(head, RayHead) and head.token_path:  # the token's own folder, made by write_token
        shutil.rmtree(Path(head.token_path).parent, ignore_errors=True)
    if remove_temp_dir and isinstance(head, RayHead) and Path(head.temp_dir).name.startswith("rlbus-ray-"):
        shutil.rmtree(head.temp_dir, ignore_errors=True)


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _is_loopback(address: str) -> bool:
    """An address Ray rewrites to the machine's routable IP unless told it is a loopback-only cluster."""
    return _host(address) in ("localhost", LOOPBACK, "::1")


def use_loopback() -> None:
    """Make this process treat its node as 127.0.0.1, as a loopback-only head requires of its drivers.

    Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import, into ray_constants.ENABLE_RAY_CLUSTER; when Ray
    was imported before we knew the address, that constant is set here to the value the variable would give
    (Ray reads the constant at call time). Otherwise Ray rewrites "127.0.0.1:port" to the routable IP and cannot
    reach a head that listens on loopback only.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # for child processes
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _reload_auth_settings() -> None:
    """Make Ray in this process re-read RAY_AUTH_MODE and its token from the environment.

    Ray caches both the first time it needs them (the mode in its C++ RayConfig, the token in its token loader), so
    a process that touched Ray before it learnt about the head would keep sending no token (or a stale one). This is
    what Ray itself does when `ray.init` turns token mode on (authentication_token_setup._enable_token_auth). Only
    called before this process's ray.init."""
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode

    wanted = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    if wanted != (get_authentication_mode() == AuthenticationMode.TOKEN):
        Config.initialize("")  # re-reads every RAY_<setting> variable; the cluster's own settings come with ray.init
    AuthenticationTokenLoader.instance().reset_cache()


def ensure_ray(cfg: RayConfig) -> str:
    """Initialise Ray in this process unless it already is, and return the cluster's GCS address.

    cfg.address "" starts a loopback head owned by this process (stopped at exit) and connects to it; any other
    value ("auto", "host:port") connects to that cluster. Logging is kept quiet; there is no dashboard.
    """
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    address = cfg.address
    if not address:
        # PR_SET_PDEATHSIG fires when the starting *thread* ends: tie the head to it only on the main thread
        # (callers may run this in asyncio.to_thread); otherwise the atexit hook below is what stops it.
        head = start_ray_head(
            num_cpus=cfg.num_cpus,
            object_store_memory=cfg.object_store_memory,
            die_with_parent=threading.current_thread() is threading.main_thread(),
        )
        # Registered before ray.init, so it runs after Ray's own shutdown hook (atexit is last-in, first-out).
        atexit.register(stop_ray_head, head)
        head.apply_env()
        address = head.address
    node_ip = cfg.node_ip_address
    if not node_ip and _host(address).startswith("127.") and not _is_loopback(address):
        node_ip = _host(address)  # a multi-node cluster on loopback: attach to the head's node unless told
    if _is_loopback(address) and not node_ip:
        use_loopback()
    _await_marked_up()
    _reload_auth_settings()
    ray.init(
        address=address,
        namespace=cfg.namespace,
        logging_level=logging.WARNING,
        log_to_driver=False,
        # Which node of the cluster this process attaches to (its local raylet and object store): on real machines
        # Ray finds it; several nodes on one machine's loopback addresses need it said.
        _node_ip_address=node_ip or None,
    )
    log.info("Ray: attached to node %s of the cluster at %s", ray.util.get_node_ip_address(), address)
    return ray.get_runtime_context().gcs_address
