"""`rlbus ui RUN_DIR`: a web inspector of a live or finished run, on loopback, behind the run's access token.

    rlbus ui runs/quickstart                      # prints http://127.0.0.1:PORT/?token=...; open it
    rlbus ui runs/quickstart --port 8765
    rlbus up configs/quickstart.yaml --ui         # the same, started beside the run

Pages (cli/ui_static/): the run at a glance, samples token by token, producers, two steps compared with a what-if
replay. Everything is read from the run directory alone (cli/ui_index.py indexes it; cli/ui_views.py answers), so a
finished run copied to another machine opens the same; while the run goes on, each request first reads what the
files gained. Charts are drawn by plotly.js, served from the `plotly` package (the `ui` extra), never from a CDN.

Access: every request needs the run's UI token, kept in `RUN_DIR/creds/ui.json` (mode 0600 in a 0700 folder, as the
run's bus credentials are; bus/auth.py): as `Authorization: Bearer TOKEN`, or the cookie set when the printed URL
(`/?token=TOKEN`) is opened. Anything else is answered 401. The server binds loopback addresses only.

Replay: "replay this step" runs `rlbus replay RUN_DIR --from-step K --json OUT [overrides]` as a child process
(one at a time) and shows its metrics beside the recorded ones. A sample's proximal log-probs (not recorded) are
recomputed the same way on request (cli/ui_proximal.py).

Tests: `pytest tests/unit/test_ui_index.py tests/system/test_inspector.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hmac
import importlib.util
import ipaddress
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from rlbus.bus.auth import private_dir, write_private
from rlbus.cli.run_lock import LOCK_NAME
from rlbus.cli.ui_index import RunIndex
from rlbus.cli.ui_proximal import proximal_path
from rlbus.cli.ui_views import Tokens, compare, overview, producers, samples_page
from rlbus.common.files import write_atomic

STATIC = Path(__file__).parent / "ui_static"
COOKIE = "rlbus_ui"
TOKEN_FILE = "ui.json"
ADDRESS_FILE = "address"
REFRESH_EVERY_S = 1.0
_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=\S*$")


def plotly_js() -> Path:
    """plotly.min.js as the `plotly` wheel ships it (its package data)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise SystemExit("rlbus ui needs plotly (its charts' JavaScript): pip install 'rlbus[ui]'")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise SystemExit(f"rlbus ui: {path} is missing from the installed plotly")
    return path


def ui_token(run_dir: Path) -> str:
    """The run's UI token, made once (256 bits) and kept in RUN_DIR/creds/ui.json, 0600. A run directory that cannot
    be written gets a token for this server's lifetime only."""
    path = run_dir / "creds" / TOKEN_FILE
    if path.is_file():
        return json.loads(path.read_text())["token"]
    token = secrets.token_urlsafe(32)
    try:
        private_dir(path.parent)
        write_private(path, json.dumps({"token": token}))
    except OSError:
        pass
    return token


def check_loopback(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise SystemExit(f"rlbus ui: --host {host} is not a loopback address; the inspector serves loopback only "
                         "(reach it from elsewhere through an SSH tunnel)")


def run_is_live(run_dir: Path) -> bool:
    """Whether a launcher or a role holds the run directory's lock (cli/run_lock.py) now: probed without waiting
    and let go at once."""
    path = run_dir / LOCK_NAME
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock, if it got one
    return False


class Jobs:
    """Background work started from the page, one at a time, each a child process: `rlbus replay` runs and proximal
    log-prob recomputations (cli/ui_proximal.py). Their output stays in RUN_DIR/ui."""

    run_dir: Path
    folder: Path
    jobs: dict[int, dict[str, Any]]
    _procs: dict[int, subprocess.Popen]

    def __init__(self, run_dir: Path, folder: Path):
        self.run_dir, self.folder = run_dir, folder
        self.jobs, self._procs = {}, {}

    def replay(self, from_step: int, steps: int, overrides: list[str]) -> dict[str, Any]:
        bad = [o for o in overrides if not _OVERRIDE.match(o)]
        if bad or from_step < 1 or not 1 <= steps <= 20:
            raise web.HTTPBadRequest(text=f"overrides must be key=value ({bad}); 1 <= steps <= 20, from_step >= 1")
        out = self.folder / "replays" / f"replay_{len(self.jobs) + 1}.json"
        return self._start("replay", ["-m", "rlbus.cli", "replay", str(self.run_dir), "--from-step", str(from_step),
                                      "--steps", str(steps), "--json", str(out), *overrides], out,
                           {"from_step": from_step, "steps": steps, "overrides": overrides})

    def proximal(self, step: int) -> dict[str, Any]:
        out = proximal_path(self.folder, step)
        return self._start("proximal", ["-m", "rlbus.cli.ui_proximal", str(self.run_dir), "--step", str(step),
                                        "--out", str(out)], out, {"step": step})

    def _start(self, kind: str, args: list[str], out: Path, info: dict[str, Any]) -> dict[str, Any]:
        if any(p.poll() is None for p in self._procs.values()):
            raise web.HTTPConflict(text="a replay is already running; wait for it")
        job_id = len(self.jobs) + 1
        out.parent.mkdir(parents=True, exist_ok=True)
        log = out.with_suffix(".log")
        with open(log, "wb") as f:
            self._procs[job_id] = subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT,
                                                   start_new_session=True)
        command = ["rlbus", *args[3:]] if kind == "replay" else ["python", *args]
        self.jobs[job_id] = {"id": job_id, "kind": kind, **info, "command": command, "started": time.time(),
                             "out": str(out), "log": str(log)}
        return self.status(job_id)

    def status(self, job_id: int) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            raise web.HTTPNotFound(text=f"no job {job_id}")
        code = self._procs[job_id].poll()
        ok = code in (0, 1) if job["kind"] == "replay" else code == 0  # replay: 1 = it differs (--strict only)
        state = "running" if code is None else ("done" if ok and Path(job["out"]).is_file() else "failed")
        out = {**{k: v for k, v in job.items() if k not in ("out", "log")}, "state": state, "exit": code}
        if state == "done" and job["kind"] == "replay":  # non-finite metrics (a NaN reproduced) as null
            out["result"] = json.loads(Path(job["out"]).read_text(), parse_constant=lambda _: None)
        if state == "failed":
            out["log_tail"] = Path(job["log"]).read_text(errors="replace")[-3000:]
        return out

    def stop(self) -> None:
        for p in self._procs.values():
            if p.poll() is None:
                p.terminate()  # our own child, by pid
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


class Inspector:
    """The aiohttp application of one run directory."""

    run_dir: Path
    token: str
    index: RunIndex
    tokens: Tokens
    jobs: Jobs
    _lock: threading.Lock  # one index connection, used from worker threads one at a time
    _refreshed: float

    def __init__(self, run_dir: Path, token: str, index: RunIndex):
        self.run_dir, self.token, self.index = run_dir, token, index
        self.tokens = Tokens(run_dir, index.path.parent)
        self.jobs = Jobs(run_dir, index.path.parent)
        self._lock, self._refreshed = threading.Lock(), time.monotonic()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        for path, view in (("/api/info", self._info), ("/api/overview", self._overview),
                           ("/api/samples", self._samples), ("/api/sample/{id}", self._sample),
                           ("/api/group", self._group), ("/api/producers", self._producers),
                           ("/api/compare", self._compare), ("/api/replay/{id}", self._replay_status)):
            app.router.add_get(path, view)
        app.router.add_post("/api/replay", self._replay)
        app.router.add_post("/api/proximal", self._proximal)
        app.on_shutdown.append(self._shutdown)
        return app

    # -- access ----------------------------------------------------------------------------------------------------

    def _valid(self, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        bearer = request.headers.get("Authorization", "")
        if self._valid(request.cookies.get(COOKIE)) or self._valid(bearer.removeprefix("Bearer ").strip() or None):
            return await handler(request)
        if request.path == "/" and self._valid(request.query.get("token")):
            # The printed URL: keep the token in a cookie for this origin and take it out of the address bar.
            resp = web.HTTPFound("/")
            resp.set_cookie(COOKIE, self.token, httponly=True, samesite="Strict", path="/")
            raise resp
        raise web.HTTPUnauthorized(text="rlbus ui: open the URL `rlbus ui` printed (it carries the run's token, "
                                        "also in RUN_DIR/creds/ui.json)")

    # -- pages -----------------------------------------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "plotly.min.js":
            return web.FileResponse(plotly_js(), headers={"Cache-Control": "max-age=86400"})
        path = STATIC / name
        if name.startswith(".") or "/" in name or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    async def _read(self, fn: Callable[[], Any]) -> web.Response:
        """Run `fn` on a worker thread with the index caught up (at most once a second)."""
        def run() -> Any:
            with self._lock:
                if time.monotonic() - self._refreshed >= REFRESH_EVERY_S:
                    self.index.refresh()
                    self._refreshed = time.monotonic()
                return fn()

        try:
            return web.json_response(await asyncio.to_thread(run), dumps=_dumps)
        except (KeyError, ValueError) as e:
            raise web.HTTPBadRequest(text=str(e)) from None

    async def _info(self, request: web.Request) -> web.Response:
        def info() -> dict[str, Any]:
            steps = self.index.db.execute("SELECT count(*), max(step) FROM steps").fetchone()
            return {"run_dir": str(self.run_dir), "name": self.run_dir.name, "steps": steps[0],
                    "last_step": steps[1] or 0, "live": run_is_live(self.run_dir)}
        return await self._read(info)

    async def _overview(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", 0))
        return await self._read(lambda: overview(self.index, since))

    async def _samples(self, request: web.Request) -> web.Response:
        return await self._read(lambda: samples_page(self.index, dict(request.query)))

    async def _sample(self, request: web.Request) -> web.Response:
        sample_id = int(request.match_info["id"])
        return await self._read(lambda: self.tokens.sample(self.index, sample_id))

    async def _group(self, request: web.Request) -> web.Response:
        step, gpos = int(request.query["step"]), int(request.query["gpos"])

        def group() -> list[dict[str, Any]]:
            ids = [r[0] for r in self.index.db.execute("SELECT id FROM samples WHERE step=? AND gpos=? ORDER BY spos",
                                                       (step, gpos))]
            return [self.tokens.sample(self.index, i) for i in ids]
        return await self._read(group)

    async def _producers(self, request: web.Request) -> web.Response:
        return await self._read(lambda: producers(self.index))

    async def _compare(self, request: web.Request) -> web.Response:
        a, b = int(request.query["a"]), int(request.query["b"])
        return await self._read(lambda: compare(self.index, a, b))

    async def _replay(self, request: web.Request) -> web.Response:
        body = await request.json()
        overrides = [o.strip() for o in body.get("overrides", []) if o.strip()]
        job = self.jobs.replay(int(body["from_step"]), int(body.get("steps", 1)), overrides)
        return web.json_response(job, dumps=_dumps)

    async def _proximal(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(self.jobs.proximal(int(body["step"])), dumps=_dumps)

    async def _replay_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.jobs.status(int(request.match_info["id"])), dumps=_dumps)

    async def _shutdown(self, app: web.Application) -> None:
        await asyncio.to_thread(self.jobs.stop)


def _dumps(obj: Any) -> str:
    try:
        return json.dumps(obj, allow_nan=False, default=str)
    except ValueError:  # a NaN or an infinity (a metrics row may hold one): JSON has none, the page shows "-"
        return json.dumps(_finite(obj), allow_nan=False, default=str)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


async def serve(run_dir: Path, host: str, port: int, *, show_token: bool = True) -> None:
    check_loopback(host)
    plotly_js()  # fail now, not on the first page
    # torch and the trainer's advantage code load on the first sample page otherwise (about a second here): warm them
    # meanwhile, from the start, as the index is read (sqlite works outside the GIL).
    threading.Thread(target=_warm, daemon=True).start()
    index = await asyncio.to_thread(RunIndex.open, run_dir)
    inspector = Inspector(run_dir, ui_token(run_dir), index)
    runner = web.AppRunner(inspector.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # port 0: the one the OS chose
    # No secret in it. Written whole, then renamed into place: a reader that waits for the file never reads it empty.
    address = index.path.parent / ADDRESS_FILE
    write_atomic(address, f"http://{host}:{bound}/\n")
    url = f"http://{host}:{bound}/"
    print(f"rlbus ui: {run_dir} at {url}?token={inspector.token}" if show_token else
          f"rlbus ui: {run_dir} at {url} (token in {run_dir / 'creds' / TOKEN_FILE})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a clean stop: a replay child started from the page goes too
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        index.close()


def _warm() -> None:
    import rlbus.trainer.algorithms.advantages  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlbus ui", description="A web inspector of a live or finished run directory.")
    p.add_argument("run_dir", help="the run directory (live, finished, or copied from elsewhere)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    p.add_argument("--hide-token", action="store_true",
                   help="print the address without the token (rlbus up prints the URL itself)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        asyncio.run(serve(run_dir, args.host, args.port, show_token=not args.hide_token))
    except FileNotFoundError as e:
        print(f"rlbus ui: {e}", file=sys.stderr)
        return 2
    return 0
