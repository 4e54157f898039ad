"""`rlbus up CONFIG [overrides]`: the all-in-one launcher.

    rlbus up configs/quickstart.yaml
    rlbus up configs/quickstart.yaml trainer.total_steps=60 rollout.num_producers=3

Starts the embedded bus unless `bus.url` is given, a local Ray head unless `ray.address` is given, then the trainer
and `rollout.num_producers` producers, each its own OS process running the same code as `rlbus trainer` /
`rlbus producer` (in its own session, so Ctrl-C reaches only the launcher, which then stops them in order). A
role that dies is reported and restarted, unless it exits with CONFIG_ERROR_EXIT (2: it refused the config, and
would again): the run stops then, with the role's message, and `rlbus up` exits 2. `rlbus up` checks the config
before it starts anything (cli/validate.py), so most config errors never get that far. Ctrl-C stops everything
cleanly; the trainer checkpoints on the way out, so `rlbus up` on the same run directory resumes.

Elastic producers: `rlbus scale RUN_DIR N` writes N to `RUN_DIR/scale`; the launcher reads it within a second,
starts producers up to N or sends SIGTERM to the newest ones down to N (a removed producer finishes or gives back
its tasks, then exits, and is not restarted), announces `ProducersScaled` on the bus and writes what it runs to
`RUN_DIR/producers.json`. A new `rlbus up` starts from `rollout.num_producers` again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.text import Text

from rlbus.bus.auth import Role, load_creds, private_dir, write_private
from rlbus.bus.client import Bus
from rlbus.bus.loop import run
from rlbus.bus.ray_cluster import RayHead, await_ray_head, head_running, start_ray_head, stop_ray_head
from rlbus.bus.server import EmbeddedServer
from rlbus.cli.progress import RunMonitor, summary_table
from rlbus.cli.child import Child
from rlbus.cli.preload import RoleServer, preload_modules
from rlbus.cli.run_lock import RunDirBusy, RunLock
from rlbus.cli.validate import CONFIG_ERROR_EXIT
from rlbus.common.files import write_atomic
from rlbus.common.model.ensure import ensure_model
from rlbus.schemas.config import BusConfig, RunConfig
from rlbus.schemas.config_io import to_yaml
from rlbus.schemas.errors import BusError
from rlbus.schemas.judge import URL_FILE as JUDGE_URL_FILE
from rlbus.schemas.wire import ProducersScaled
from rlbus.trainer.metrics import require_wandb

#: How long a new `rlbus up` waits for the roles of an earlier one (say, SIGKILLed) to exit before giving up.
RUN_LOCK_WAIT_S = 300.0
#: A role that dies this many times in a row before it got going (announced RoleStarted) makes the launcher give
#: up: that is a role that cannot start (a crash at start-up), not a fault to ride out. Deaths after it got going
#: are faults (a SIGKILL, an OOM): they are restarted however often they happen. A role that exits with
#: CONFIG_ERROR_EXIT is never restarted: it refused the config, and would refuse it every time.
MAX_START_FAILURES = 5
#: Seconds the run's own Ray head gets after SIGTERM before its process group is SIGKILLed (bus/ray_cluster.py).
RAY_STOP_GRACE_S = 1.0
#: `rlbus scale` writes the wanted number of producers here; the launcher reports what it runs in PRODUCERS_FILE.
SCALE_FILE = "scale"
PRODUCERS_FILE = "producers.json"


def read_scale(run_dir: Path) -> int | None:
    """The producer count asked for in RUN_DIR/scale, None if there is no request; ValueError if it is not one."""
    path = run_dir / SCALE_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"{path} holds {text!r}; expected a number of producers (>= 0)")
    return int(text)


def write_scale(run_dir: Path, n: int) -> Path:
    """Ask the launcher of RUN_DIR for `n` producers (atomically: it never reads half a number)."""
    if n < 0:
        raise ValueError(f"number of producers must be >= 0, not {n}")
    path = run_dir / SCALE_FILE
    tmp = path.with_name(f".{SCALE_FILE}.{os.getpid()}")
    tmp.write_text(f"{n}\n")
    tmp.replace(path)
    return path


def _role_argv(role: str, config_path: Path, *extra: str, creds: Path | None = None) -> list[str]:
    # A credential file's path (never a secret) as an override, before the role's own flags.
    own = [f"bus.creds_file={creds}"] if creds is not None else []
    return [sys.executable, "-m", "rlbus.cli", role, str(config_path), *own, *extra]


class Launcher:
    cfg: RunConfig
    run_dir: Path
    server: EmbeddedServer | None  # the embedded bus, when the config gives no bus.url
    ray_head: RayHead | None  # the loopback Ray head, when the config gives no ray.address
    trainer: Child | None
    producers: list[Child]  # running and supervised, oldest first
    evaluator: Child | None  # the held-out evaluation role, when eval.interval > 0
    judge: Child | None  # the run's judge role (`rlbus judge`), when judge.model is set and judge.url is not
    ui: Child | None  # the web inspector (`rlbus up --ui`), stopped with the run
    retiring: dict[str, asyncio.Task]  # producer id -> its stop, for producers scaled away (never restarted)
    _server: RoleServer | None  # the fork server of the roles (launcher.preload)
    _launch: Path | None  # the children's config file
    _scale_seen: int | None  # the last RUN_DIR/scale request applied (or refused)
    _target: int  # producers the launcher keeps running
    _reported: Any  # the state last written to PRODUCERS_FILE
    _started: dict[str, float]  # role id -> wall time of its last RoleStarted (the monitor's, once it runs)
    _stop: asyncio.Event
    _console: Console

    def __init__(self, cfg: RunConfig, *, entry: Callable[[list[str]], int], ui: bool = False):
        self.cfg = cfg
        self._entry = entry  # the CLI's main, which forked roles run
        self.run_dir = cfg.run_dir
        self.want_ui = ui
        self.ui = None
        self.server = self.ray_head = self.trainer = None
        self.producers, self.retiring = [], {}
        self.evaluator = self.judge = None
        self._server = None
        self._launch, self._scale_seen = None, None
        self._target, self._reported, self._started = cfg.rollout.num_producers, None, {}
        self._stop = asyncio.Event()
        self._console = Console(stderr=True)

    # -------------------------------------------------------------- infrastructure

    def _start_infrastructure(self) -> RunConfig:
        """Start what the config does not point at; return the config the children get (addresses filled in)."""
        cfg = self.cfg
        bus_cfg, ray_cfg = cfg.bus, cfg.ray
        if not bus_cfg.url:
            store = Path(bus_cfg.embedded_dir) if bus_cfg.embedded_dir else self.run_dir / "bus"
            self.server = EmbeddedServer(store, port=0, runs=[cfg.name]).start()
            # Children get no credential through launch.yaml: each is handed only its role's file (_role_argv).
            bus_cfg = msgspec.structs.replace(bus_cfg, url=self.server.url, creds_file="")
            self._console.print(f"[dim]bus[/dim] {self.server.url} (store {store})")
        if not ray_cfg.address:
            # Not waited for here: the roles start meanwhile (importing torch, loading the model) and wait for the
            # head in ensure_ray; _run_locked waits for it once they are started. On 2 cores start-up is CPU-bound
            # and this gained 0.3 s (docs/benchmarks.md); with more cores the head's ~3 s overlap the imports.
            self.ray_head = start_ray_head(num_cpus=ray_cfg.num_cpus, object_store_memory=ray_cfg.object_store_memory,
                                           wait=False)
            self.ray_head.apply_env()  # children inherit what they need to join this head (no secret: a file path)
            ray_cfg = msgspec.structs.replace(ray_cfg, address=self.ray_head.address)
        if bus_cfg.password or bus_cfg.token:
            bus_cfg = self._secrets_to_file(bus_cfg)
        return msgspec.structs.replace(cfg, bus=bus_cfg, ray=ray_cfg)

    def _secrets_to_file(self, bus_cfg: BusConfig) -> BusConfig:
        """A password or token given on the command line reaches the children through a 0600 file in a 0700
        directory of the run, never through launch.yaml or their command lines."""
        path = private_dir(self.run_dir / "creds") / "bus.json"
        secret = {"token": bus_cfg.token} if bus_cfg.token else {"user": bus_cfg.user, "password": bus_cfg.password}
        write_private(path, json.dumps({**secret, "url": bus_cfg.url}, indent=2) + "\n")
        return msgspec.structs.replace(bus_cfg, creds_file=str(path), user="", password="", token="")

    def _creds(self, role: Role) -> Path | None:
        """The credential file of `role`: the embedded bus's, or, when `bus.creds_file` is the admin file `rlbus bus
        up` wrote for this run (a server or cluster run apart), its sibling for `role`; else None (the config's own
        credentials go to every child)."""
        if self.server is not None:
            return self.server.creds_file(role, self.cfg.name)
        given = self.cfg.bus.creds_file
        if not given or self.cfg.bus.user or self.cfg.bus.token:
            return None
        with contextlib.suppress(BusError):
            creds = load_creds(given)
            sibling = Path(given).with_name(f"{role}.json")
            if creds.get("role") == "admin" and creds.get("run") == self.cfg.name and sibling.is_file():
                return sibling
        return None

    def _with_creds(self, cfg: RunConfig, role: Role) -> RunConfig:
        path = self._creds(role)
        return cfg if path is None else msgspec.structs.replace(
            cfg, bus=msgspec.structs.replace(cfg.bus, creds_file=str(path)))

    async def _ensure_streams(self, cfg: RunConfig) -> None:
        async with await Bus.connect(cfg.bus, cfg.name, name="launcher") as bus:
            await bus.ensure_streams(traj_max_ack_pending=cfg.traj_max_ack_pending)

    def _stop_infrastructure(self) -> None:
        if self.ray_head is not None:
            # Every child has exited: nothing needs the head's objects, and `ray start --block` winds down on
            # SIGTERM slower than the default grace (5 s, all of it spent at every run's end before the SIGKILL).
            stop_ray_head(self.ray_head, timeout_s=RAY_STOP_GRACE_S)
        if self.server is not None:
            self.server.stop()

    # -------------------------------------------------------------- supervision

    async def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # One launcher per run directory, and none while an earlier one's roles still shut down (cli/run_lock.py).
        try:
            lock = await asyncio.to_thread(RunLock.acquire, self.run_dir, wait_s=RUN_LOCK_WAIT_S,
                                           on_wait=lambda m: self._console.print(f"[yellow]{m}[/yellow]"))
        except RunDirBusy as e:
            self._console.print(f"[red]{e}[/red]")
            return 1
        os.environ.update(lock.env())  # every role started from here holds it shared
        try:
            return await self._run_locked()
        finally:
            lock.release()

    async def _run_locked(self) -> int:
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        self._console.print(f"[bold]rlbus up[/bold] run [cyan]{self.cfg.name}[/cyan] in {self.run_dir}")
        # A missing optional package or W&B login fails here, not in a trainer restarted again and again.
        require_wandb(self.cfg.logging, check_login=True)
        await asyncio.to_thread(ensure_model, self.cfg.model)  # once, before children race to build it
        if self.want_ui:
            self._start_ui()
        child_cfg = self._start_infrastructure()
        # Started after the Ray head's env is set (the server imports Ray with it), and now, so that its imports
        # overlap the head's start and the streams' set-up; the first role's start waits for them.
        self._server = RoleServer(preload_modules(child_cfg), self._entry) if child_cfg.launcher.preload else None
        try:
            launch = self.run_dir / "launch.yaml"
            launch.write_text(to_yaml(child_cfg))
            if self.server is not None:  # set the run's streams up with the admin credential, once
                await self._ensure_streams(self._with_creds(child_cfg, "admin"))
            self._launch = launch
            (self.run_dir / SCALE_FILE).unlink(missing_ok=True)  # a request to a launcher that is gone
            self.trainer = Child("trainer", _role_argv("trainer", launch, creds=self._creds("trainer")),
                                 self.run_dir / "logs" / "trainer.log", server=self._server)
            self.trainer.start()
            if child_cfg.judge.model and not child_cfg.judge.url:  # producers find it by its URL file in the run dir
                self.judge = Child("judge", _role_argv("judge", launch), self.run_dir / "logs" / "judge.log",
                                   server=self._server)
                self.judge.start()
            for _ in range(child_cfg.rollout.num_producers):
                self._add_producer()
            if child_cfg.eval.interval > 0:  # with the producers' credential: it reads weights, publishes events
                self.evaluator = Child("evaluator", _role_argv("evaluator", launch, creds=self._creds("producer")),
                                       self.run_dir / "logs" / "evaluator.log", role_id="evaluator",
                                       server=self._server)
                self.evaluator.start()
            self._report_producers()
            if self.ray_head is not None:
                await asyncio.to_thread(await_ray_head, self.ray_head)
                self._console.print(f"[dim]ray[/dim] {self.ray_head.address}")
            return await self._supervise(child_cfg)
        finally:
            await self._stop_children()
            if self.ui is not None:
                await self.ui.stop(timeout=10.0)
            self._stop_infrastructure()

    def _start_ui(self) -> None:
        """`rlbus ui RUN_DIR` beside the run, on a free loopback port; the URL with the run's token goes to this
        console only (the inspector's own log names the token's file, not the token)."""
        from rlbus.bus.ray_cluster import free_port
        from rlbus.cli.ui import ui_token

        port, token = free_port(), ui_token(self.run_dir)  # the token first: the child reads the same file
        self.ui = Child("ui", [sys.executable, "-m", "rlbus.cli", "ui", str(self.run_dir), "--port", str(port),
                               "--hide-token"], self.run_dir / "logs" / "ui.log", role_id="ui")
        self.ui.start()
        self._console.print(f"[bold]inspector[/bold] http://127.0.0.1:{port}/?token={token}")

    async def _supervise(self, child_cfg: RunConfig) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        monitor = RunMonitor(self._with_creds(child_cfg, "observer"), self.producers, self._console)
        self._started = monitor.started
        async with monitor:
            while True:
                code = self.trainer.poll()
                if code == 0:
                    monitor.stop()
                    # The producers' drain and exit and the final model's export need nothing of each other:
                    # overlap them (the run's end waited for the export, then for the producers).
                    stopping = asyncio.create_task(self._stop_children())
                    try:
                        return await asyncio.to_thread(self._finish)
                    finally:
                        await stopping
                if self._stop.is_set():
                    monitor.stop()
                    self._console.print("[yellow]stopping: the trainer checkpoints, producers give back their "
                                        "tasks; run the same command again to resume[/yellow]")
                    await self._stop_children()
                    return 130
                self._restart_dead_bus()
                child_cfg = await self._restart_dead_ray(child_cfg)
                await self._apply_scale(child_cfg)
                self._reap_retired()
                self._report_producers()
                # The trainer resumes from its checkpoint; the groups of the steps it lost are redelivered to it.
                for child in [self.trainer, *self.producers, *([self.evaluator] if self.evaluator else [])]:
                    started = monitor.started.get(child.role_id, 0.0)
                    if (code := self._restart_if_dead(child, got_going=started >= child.started_at)) is not None:
                        monitor.stop()
                        return code
                if self.judge is not None and (
                        code := self._restart_if_dead(self.judge, got_going=self._judge_served())) is not None:
                    monitor.stop()
                    return code
                await asyncio.sleep(0.5)

    def _judge_served(self) -> bool:
        """Whether the judge got going since its last start: it writes its URL file once it serves (it is on no bus,
        so no RoleStarted says so)."""
        url_file = self.run_dir / JUDGE_URL_FILE
        return self.judge is not None and url_file.is_file() and url_file.stat().st_mtime >= self.judge.started_at

    def _restart_if_dead(self, child: Child, *, got_going: bool) -> int | None:
        """Restart `child` if it died. When the launcher gives up instead, the run's exit status: CONFIG_ERROR_EXIT
        when the role refused its config (started again, it would refuse it again: a task its environment does not
        have, an import path that does not resolve), 1 when it keeps dying before it gets going."""
        code = child.poll()
        if code is None:
            return None
        if code == CONFIG_ERROR_EXIT:
            self._console.print(f"[red]{child.name} exited with code {code}: it refused the run's config; not "
                                f"restarting it, stopping the run[/red] (log {child.log_path}):")
            self._console.print(Text(child.config_error(), style="red"))  # text: a field such as env.tasks[0]
            return CONFIG_ERROR_EXIT
        child.start_failures = 0 if got_going else child.start_failures + 1
        if child.start_failures >= MAX_START_FAILURES:
            self._console.print(f"[red]{child.name} exited with code {code} {child.start_failures} times in a row "
                                f"before it got going[/red]; its log ({child.log_path}) ends with:")
            self._console.print(Text(child.log_tail()))
            return 1
        child.restarts += 1
        self._console.print(f"[yellow]{child.name} exited with code {code}; restarting[/yellow] "
                            f"(restart {child.restarts}, log {child.log_path})")
        child.start()
        return None

    # -------------------------------------------------------------- elastic producers

    def _add_producer(self) -> Child:
        """Start a producer under the lowest id no running or retiring producer holds (p0, p1, ...)."""
        assert self._launch is not None
        taken = {p.role_id for p in self.producers} | set(self.retiring)
        i = next(i for i in range(len(taken) + 1) if f"p{i}" not in taken)
        argv = _role_argv("producer", self._launch, "--id", f"p{i}", creds=self._creds("producer"))
        child = Child(f"producer-{i}", argv, self.run_dir / "logs" / f"producer-{i}.log", role_id=f"p{i}",
                      server=self._server)
        child.start()
        self.producers.append(child)
        return child

    async def _apply_scale(self, child_cfg: RunConfig) -> None:
        """Follow RUN_DIR/scale: start producers up to the number asked for, or retire the newest down to it."""
        try:
            target = read_scale(self.run_dir)
        except ValueError as e:
            if self._scale_seen != -1:
                self._console.print(f"[red]scale request refused[/red]: {e}")
            self._scale_seen = -1
            return
        if target is None or target == self._scale_seen:
            return
        self._scale_seen = target
        previous = len(self.producers)
        added = [self._add_producer().role_id for _ in range(target - previous)]
        removed = []
        while len(self.producers) > target:
            child = self.producers.pop()  # the newest: the oldest keep their warm engines
            # SIGTERM: it finishes or naks the tasks it holds and says RoleStopped; never restarted from here on.
            self.retiring[child.role_id] = asyncio.create_task(child.stop(), name=f"retire-{child.role_id}")
            removed.append(child.role_id)
        if added or removed:
            self._console.print(f"[cyan]producers {previous} -> {target}[/cyan]"
                                + (f" started {', '.join(added)}" if added else "")
                                + (f" draining {', '.join(removed)}" if removed else ""))
            await self._announce(child_cfg, ProducersScaled(target=target, previous=previous, added=added,
                                                            removed=removed))
        self._target = target

    def _reap_retired(self) -> None:
        done = [pid for pid, task in self.retiring.items() if task.done()]
        for producer_id in done:
            task = self.retiring.pop(producer_id)
            code = task.result()
            self._console.print(f"[dim]{producer_id} drained and exited with code {code}[/dim]")

    def _report_producers(self) -> None:
        """RUN_DIR/producers.json, rewritten when it changes: the target, what runs (pid, and whether it got going:
        announced RoleStarted since its last start) and what drains, for `rlbus scale --wait` and the curious."""
        state = {"target": self._target,
                 "running": {p.role_id: p.pid for p in self.producers},
                 "ready": [p.role_id for p in self.producers if self._started.get(p.role_id, 0.0) >= p.started_at],
                 "draining": sorted(self.retiring)}
        if state == self._reported:
            return
        self._reported = state
        write_atomic(self.run_dir / PRODUCERS_FILE, json.dumps({**state, "updated_at": time.time()}, indent=2) + "\n")

    async def _announce(self, child_cfg: RunConfig, event: ProducersScaled) -> None:
        """Put the change in the run's event log (the admin's credential when the launcher runs the bus)."""
        try:
            async with await Bus.connect(self._with_creds(child_cfg, "admin").bus, child_cfg.name,
                                         name="launcher") as bus:
                await bus.publish_event(event)
        except (BusError, OSError, TimeoutError) as e:  # the bus restarting: the change stands anyway
            self._console.print(f"[yellow]could not announce {event.previous} -> {event.target} producers: {e}[/yellow]")

    def _restart_dead_bus(self) -> None:
        """An embedded nats-server that died is started again on its store and port: clients reconnect to the same
        URL with their own backoff, and JetStream's file store keeps every stream and consumer."""
        if self.server is None or self.server.is_running():
            return
        self._console.print(f"[yellow]nats-server exited; restarting it on {self.server.store_dir}[/yellow]")
        self.server.restart()

    async def _restart_dead_ray(self, child_cfg: RunConfig) -> RunConfig:
        """A Ray head the launcher started that died took the TransferQueue and the weight store with it, and every
        role's connection to Ray. Every role is stopped, a new head started, and the roles started again against it:
        the trainer from its checkpoint (it republishes that version into the new weight store), producers from the
        newest weights; groups whose payloads died with the head are re-issued by name (PayloadMissing)."""
        if self.ray_head is None or head_running(self.ray_head):
            return child_cfg
        self._console.print("[yellow]Ray head exited; stopping every role, starting a new head, starting them "
                            "again[/yellow]")
        await self._stop_children()
        stop_ray_head(self.ray_head)  # whatever is left of its process group, its temp dir and token
        ray_cfg = self.cfg.ray
        self.ray_head = start_ray_head(num_cpus=ray_cfg.num_cpus, object_store_memory=ray_cfg.object_store_memory)
        self.ray_head.apply_env()
        child_cfg = msgspec.structs.replace(child_cfg, ray=msgspec.structs.replace(child_cfg.ray,
                                                                                   address=self.ray_head.address))
        assert self._launch is not None
        self._launch.write_text(to_yaml(child_cfg))
        self._console.print(f"[dim]ray[/dim] {self.ray_head.address}")
        for child in [self.trainer, *self.producers, self.evaluator]:
            if child is not None:
                child.restarts += 1
                child.start()
        return child_cfg

    async def _stop_children(self) -> None:
        # All at once: the trainer checkpoints after the step in hand, producers nak what they hold. Stopping
        # producers first would let the trainer go on training from the groups already queued meanwhile.
        children = [*self.producers, *([self.trainer] if self.trainer is not None else []),
                    *([self.evaluator] if self.evaluator is not None else []),
                    *([self.judge] if self.judge is not None else [])]
        await asyncio.gather(*(c.stop() for c in children), *self.retiring.values())

    def _export(self) -> Path:
        """The final model, from the run's last checkpoint. Forked from the role server when there is one: it has
        torch and transformers imported, which the launcher would have to import first (~5 CPU-s after the last
        step). Otherwise here, importing them now (not at the top: 8 s of a contended start, before the bus and Ray
        could start, for the last thing the launcher does)."""
        ckpts, out = self.run_dir / "checkpoints", self.run_dir / "final_model"
        if self._server is None:
            from rlbus.cli.export import export_checkpoint

            return export_checkpoint(ckpts, out, self.cfg.model.path)
        log = self.run_dir / "logs" / "export.log"
        code = self._server.start(["export", str(ckpts), str(out)], dict(os.environ), log).wait()
        if code != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.is_file() else ""
            raise RuntimeError(f"`rlbus export {ckpts} {out}` failed (exit {code}); the end of {log}:\n{tail}")
        return out

    def _finish(self) -> int:
        from rlbus.cli.plot import plot_run

        cfg = self.cfg
        if cfg.logging.plot:
            self._console.print(f"curves: {plot_run(self.run_dir)}")
        self._console.print(f"final model: {self._export()}")
        if self.ray_head is None:
            # A Ray cluster of the user's: the finished run's detached actors (TransferQueue shards, weight store)
            # would outlive it there, holding memory. A head of our own goes with everything on it.
            from rlbus.bus.ray_store import teardown

            try:
                gone = teardown(cfg.name, cfg.ray)
                self._console.print(f"[dim]ray: removed the run's actors {gone}[/dim]")
            except Exception as e:  # the run is done; a cluster that cannot be reached keeps them, say so
                self._console.print(f"[yellow]could not remove the run's Ray actors ({type(e).__name__}: {e}); "
                                    f"`ray list actors` shows them as rlbus-{cfg.name}-*[/yellow]")
        self._console.print(summary_table(self.run_dir))
        return 0


def main(cfg: RunConfig, *, entry: Callable[[list[str]], int], ui: bool = False) -> int:
    """`rlbus up`; `entry` is the CLI's main (rlbus.cli.main.main), which the roles forked from the server run."""
    return run(Launcher(cfg, entry=entry, ui=ui).run())


def scale_main(run_dir: Path, n: int, *, wait: bool, timeout: float) -> int:
    """`rlbus scale RUN_DIR N [--wait]`: ask the run's launcher for N producers; with --wait, until it runs exactly
    N, each of them going (RoleStarted announced), and the removed ones have drained and exited."""
    if not (run_dir / PRODUCERS_FILE).is_file():
        print(f"rlbus scale: {run_dir} has no {PRODUCERS_FILE}: no `rlbus up` has run there", file=sys.stderr)
        return 2
    try:
        write_scale(run_dir, n)
    except ValueError as e:
        print(f"rlbus scale: {e}", file=sys.stderr)
        return 2
    print(f"asked for {n} producers ({run_dir / SCALE_FILE})")
    deadline = time.monotonic() + timeout
    state: dict = {}
    while wait:
        state = json.loads((run_dir / PRODUCERS_FILE).read_text())
        if (state["target"] == n and len(state["running"]) == n and set(state.get("ready", ())) == set(state["running"])
                and not state["draining"]):
            print(f"running {n}: {', '.join(state['running']) or 'none'}")
            return 0
        if time.monotonic() > deadline:
            print(f"rlbus scale: the launcher did not reach {n} producers within {timeout:.0f}s (it reports {state}); "
                  "is `rlbus up` still running?", file=sys.stderr)
            return 1
        time.sleep(0.3)
    return 0
