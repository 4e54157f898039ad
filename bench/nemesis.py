"""The nemesis of `bench/soak.py --nemesis`: faults of every kind drawn at random over a long `rlbus up`, from one
seed that replays the same schedule (the kinds, their order, the steps they fire at, what they pick and how long
they hold).

    .venv/bin/python bench/soak.py --nemesis --steps 600 --faults 14 --seed 7

Kinds (FAULT_KINDS): a producer SIGKILLed; a producer SIGSTOPped, then SIGCONTed after a drawn pause longer than
`bus.ack_wait_s`; the trainer SIGKILLed (the launcher restarts it); the nats-server SIGKILLed (the bench's own,
started again on its store and port after a drawn down time, as a supervisor would); a TransferQueue shard actor
killed with `ray.kill(no_restart=False)` (Ray restarts it empty); the second Ray node (127.0.0.3, started by the
bench) lost -- SIGKILL of its process group -- and started again after a drawn down time; garbage and forged
trajectory groups published with the producer credential.

`schedule` is pure (tests/unit/test_nemesis_schedule.py); `Nemesis` fires it on a live run, one `tick` at a time,
and signals only processes the bench started (the launcher's children, the nats-server, the Ray node), by pid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FAULT_KINDS = ("producer-kill", "producer-stop", "trainer-kill", "nats-kill", "shard-kill", "node-loss",
               "forged-message")  # fmt: skip
NODE_IP = "127.0.0.3"  # the second Ray node; the head is on 127.0.0.2 (bus/ray_cluster.py: nodes on loopback)
HEAD_IP = "127.0.0.2"
FORGER = "p-nemesis"  # producer_id of every forged group, to find their dead letters at the end


@dataclasses.dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    at_step: int  # fires once the run has written this step
    pick: int  # which producer / shard: an index into the sorted live ones, taken modulo their number
    hold_s: float  # producer-stop: the pause; nats-kill, node-loss: how long it stays down; else 0


def schedule(seed: int, *, steps: int, num_faults: int, kinds: Sequence[str] = FAULT_KINDS, warmup_steps: int = 10,
             tail_steps: int = 40, ack_wait_s: float = 10.0) -> list[Fault]:
    """`num_faults` faults at distinct steps in [warmup_steps, steps - tail_steps), in step order. Kinds come in
    rounds, each round every kind once in a random order, so that a run of len(kinds) faults or more has each kind."""
    if not kinds or any(k not in FAULT_KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {FAULT_KINDS}, not {list(kinds)}")
    span = range(warmup_steps, steps - tail_steps)
    if num_faults > len(span):
        raise ValueError(f"num_faults ({num_faults}) must fit in steps {span.start}..{span.stop - 1}")
    rng = random.Random(seed)
    at = sorted(rng.sample(span, num_faults))
    drawn: list[str] = []
    while len(drawn) < num_faults:
        drawn += rng.sample(list(kinds), len(kinds))
    out = []
    for i, (step, kind) in enumerate(zip(at, drawn, strict=False)):
        pick = rng.randrange(1 << 16)
        if kind == "producer-stop":
            hold = rng.uniform(ack_wait_s + 2.0, ack_wait_s + 15.0)  # past ack_wait: its task goes to another
        elif kind == "nats-kill":
            hold = rng.uniform(1.0, 8.0)
        elif kind == "node-loss":
            hold = rng.uniform(5.0, 30.0)
        else:
            hold = 0.0
        out.append(Fault(i, kind, step, pick, round(hold, 1)))
    return out


class Nemesis:
    """Fires a schedule on a live run. `tick(roles)` is called from the bench's loop (every ~0.5 s): it undoes what
    is due (SIGCONT, a server or node started again), fires the next fault once its step is reached, and notes each
    fault's stall (from the fault to the first step written after it) from `steps` (bench/nats_nemesis.Steps,
    polled by a thread of its own, so a slow sample does not lengthen a stall)."""

    faults: list[Fault]
    records: list[dict[str, Any]]
    _undo: list[tuple[float, str, Callable[[], None], dict[str, Any]]]  # (when, what, how, the fault's record)
    _stopped: set[int]  # producers SIGSTOPped and not yet woken

    def __init__(self, faults: list[Fault], *, run: str, run_dir: Path, steps: Any, server: Any, head: Any,
                 node: Any, ray_cfg: Any, producer_bus: Any, t0: float):
        self.faults, self.records, self._undo, self._stopped = list(faults), [], [], set()
        self.run, self.run_dir, self.steps, self.server, self.head, self.node = run, run_dir, steps, server, head, node
        self.ray_cfg, self.producer_bus, self.t0 = ray_cfg, producer_bus, t0
        self._next = 0

    # -- the loop's side ---------------------------------------------------------------------------------------

    def tick(self, roles: dict[str, int]) -> None:
        now = time.monotonic()
        for item in [u for u in self._undo if u[0] <= now]:
            self._undo.remove(item)
            self._do_undo(item)
        for rec in self.records:
            if rec.get("stall_s") is None and (first := self.steps.first_after(rec["_t"])) is not None:
                rec["stall_s"] = round(first - rec["_t"], 2)
        if self._next < len(self.faults) and self._max_step() >= self.faults[self._next].at_step:
            fault = self.faults[self._next]
            try:
                rec = self._fire(fault, roles)
            except Exception as e:  # noqa: BLE001 -- a fault that could not be made is reported, not a crash
                rec = {"at_step": self._max_step(), "_t": time.monotonic(), "note": f"NOT MADE: {e!r}"[:500]}
            if rec is not None:  # else: postponed to a later tick (nothing to hit right now)
                self._next += 1
                rec.update(index=fault.index, kind=fault.kind, planned_step=fault.at_step, hold_s=fault.hold_s)
                self.records.append(rec)
                print(f"t={rec['_t'] - self.t0:6.1f}s fault {fault.index} {fault.kind} at step {rec['at_step']}: "
                      f"{rec.get('target', '')} {rec.get('note', '')}", flush=True)

    def finish(self) -> None:
        """Undo everything still pending (the run ended): wake stopped producers, start what is down."""
        for item in sorted(self._undo, key=lambda u: u[0]):
            self._do_undo(item)
        self._undo.clear()

    def report(self) -> list[dict[str, Any]]:
        out = []
        for rec in self.records:
            row = {k: v for k, v in rec.items() if not k.startswith("_")}
            row["t"] = round(rec["_t"] - self.t0, 1)
            after = [seen for _, seen in self.steps.seen if seen > rec["_t"]]
            if after:  # the longest time without a step, from the fault to the 10th step line after it
                row["gap_s"] = round(self.steps.longest_gap(rec["_t"], after[min(9, len(after) - 1)]), 2)
            out.append(row)
        for fault in self.faults[self._next:]:
            out.append({"index": fault.index, "kind": fault.kind, "planned_step": fault.at_step, "fired": False})
        return out

    # -- faults ----------------------------------------------------------------------------------------------

    def _max_step(self) -> int:
        return max((s for s, _ in self.steps.seen), default=0)

    def _fire(self, fault: Fault, roles: dict[str, int]) -> dict[str, Any] | None:
        rec: dict[str, Any] = {"at_step": self._max_step()}
        kind = fault.kind
        if kind in ("producer-kill", "producer-stop"):
            live = sorted(r for r, p in roles.items() if r.startswith("producer") and p not in self._stopped)
            if not live:
                return None
            name = live[fault.pick % len(live)]
            pid = roles[name]
            os.kill(pid, signal.SIGKILL if kind == "producer-kill" else signal.SIGSTOP)  # the launcher's child
            rec.update(target=f"{name} (pid {pid})")
            if kind == "producer-stop":
                self._stopped.add(pid)
                argv = _argv(pid)
                self._later(rec, fault.hold_s, f"SIGCONT {name}", lambda: self._wake(pid, argv))
        elif kind == "trainer-kill":
            if "trainer" not in roles:
                return None  # between a death and its restart
            os.kill(roles["trainer"], signal.SIGKILL)  # the launcher's child
            rec.update(target=f"trainer (pid {roles['trainer']})")
        elif kind == "nats-kill":
            if not self.server.is_running():
                return None
            pid = self.server.pid
            os.kill(pid, signal.SIGKILL)  # the server this bench started
            rec.update(target=f"nats-server (pid {pid})")
            self._later(rec, fault.hold_s, "nats-server started again", self.server.restart)
        elif kind == "shard-kill":
            rec.update(self._kill_shard(fault.pick))
        elif kind == "node-loss":
            if self.node is None:
                return None  # still down (or it could not be started again: the record of that loss says so)
            held = self._actors_on(NODE_IP)
            os.killpg(self.node.pid, signal.SIGKILL)  # the second "machine" this bench started, all of it
            from rlbus.bus.ray_cluster import stop_ray_head

            stop_ray_head(self.node)  # reap it; nothing of it is left to stop
            self.node = None
            rec.update(target=f"Ray node {NODE_IP}", actors_lost=held)
            self._later(rec, fault.hold_s, f"Ray node {NODE_IP} started again", self._start_node)
        elif kind == "forged-message":
            rec.update(self._forge())
        else:  # schedule() allows only FAULT_KINDS
            raise ValueError(kind)
        rec["_t"] = time.monotonic()
        return rec

    def _later(self, rec: dict[str, Any], delay: float, what: str, how: Callable[[], None]) -> None:
        self._undo.append((time.monotonic() + delay, what, how, rec))

    def _do_undo(self, item: tuple[float, str, Callable[[], None], dict[str, Any]]) -> None:
        _, what, how, rec = item
        try:
            how()
            print(f"t={time.monotonic() - self.t0:6.1f}s {what}", flush=True)
        except Exception as e:  # noqa: BLE001 -- recorded: the report says what could not be undone
            print(f"t={time.monotonic() - self.t0:6.1f}s {what} FAILED: {e!r}", flush=True)
            rec.setdefault("undo_failed", []).append(f"{what}: {e!r}"[:500])

    def _wake(self, pid: int, argv: list[str]) -> None:
        self._stopped.discard(pid)
        if _argv(pid) == argv:  # still the producer we stopped (not gone, its pid not reused)
            os.kill(pid, signal.SIGCONT)

    def start_node(self) -> Any:
        """Start (again) the second node on NODE_IP; it joins the bench's head."""
        from rlbus.bus.ray_cluster import start_ray_node

        return start_ray_node(self.head, NODE_IP, num_cpus=1, resources={"second_node": 1},
                              object_store_memory=300 * 1024**2)

    def _start_node(self) -> None:
        self.node = self.start_node()

    def _actors_on(self, ip: str) -> list[str]:
        """Names of the run's live actors on the node at `ip` (TransferQueue shards, the weight store)."""
        import ray

        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return sorted(a["Name"] for a in ray._private.state.actors().values()
                      if a["Name"].startswith(f"rlbus-{self.run}-") and a["State"] == "ALIVE"
                      and ips.get(a["Address"]["NodeID"]) == ip)  # fmt: skip

    def _kill_shard(self, pick: int) -> dict[str, Any]:
        import ray

        from rlbus.bus.ray_store import actor_name

        n = self.ray_cfg.num_storage_actors
        name = actor_name(self.run, f"tq-{pick % n}-of-{n}")
        handle = ray.get_actor(name, namespace=self.ray_cfg.namespace)
        node = next((ip for ip in (HEAD_IP, NODE_IP) if name in self._actors_on(ip)), "?")
        ray.kill(handle, no_restart=False)  # Ray restarts it, empty, as after its worker process died
        return {"target": f"{name} (on {node})"}

    def _forge(self) -> dict[str, Any]:
        """With the producer credential: garbage on `traj` and on a heartbeat subject, a group naming a prompt never
        released, and a group naming the latest released prompt with payload keys nobody put."""
        from rlbus.consumers.event_log import read_entries

        released = read_entries(self.run_dir, "prompts")
        real = released[-1].msg.task_id if released else ""
        never = f"e{1000 + len(self.records)}-i0-a0"  # an epoch the run never reaches
        try:
            asyncio.run(asyncio.wait_for(_publish_forged(self.producer_bus, self.run, never, real), 60))
        except Exception as e:  # noqa: BLE001 -- the bus may be down (a nats-kill just before): recorded
            return {"target": "traj, events.heartbeat", "note": f"publish failed: {e!r}"[:300]}
        return {"target": "traj, events.heartbeat", "forged_never_released": never, "forged_in_flight": real}


async def _publish_forged(cfg: Any, run: str, never: str, real: str) -> None:
    from rlbus.bus.client import Bus
    from rlbus.schemas.wire import SampleMeta, TrajectoryGroup

    def group(task: str) -> TrajectoryGroup:
        """A group consistent with its task id (e<epoch>-i<index>-a<attempt>): what the feeder must catch is that
        it names no release of its own, or keys no producer put."""
        epoch, index, attempt = (int(x[1:]) for x in task.split("-"))
        samples = [SampleMeta(key=f"{task}/forged/{j}", prompt_len=4, response_len=8, reward=float(j), min_version=0,
                              max_version=0) for j in range(2)]  # fmt: skip
        return TrajectoryGroup(group_id=task, task_id=task, producer_id=FORGER, samples=samples, index=index,
                               epoch=epoch, attempt=attempt)

    async with await Bus.connect(cfg, run, name="nemesis") as bus:
        await bus.publish_raw(bus.subjects.traj, b"\x93\xa7garbage\xff\x00 not msgpack of any struct")
        await bus.publish_raw(bus.subjects.event(f"heartbeat.{FORGER}"), b"\xc1\xc1\xc1 malformed heartbeat")
        await bus.publish(bus.subjects.traj, group(never))  # no Nats-Msg-Id: the real group must still get through
        if real:
            await bus.publish(bus.subjects.traj, group(real))


def forged_outcome(run_dir: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What became of the forged messages: their dead letters (by reason), and whether each real prompt a forged
    group named was still trained (or re-issued) -- the forgery must steer nothing."""
    from rlbus.consumers.event_log import read_entries
    from rlbus.consumers.ledger import read_ledger
    from rlbus.schemas.errors import SchemaError
    from rlbus.schemas.wire import TrajectoryGroup, TypedDecoder

    groups, reasons = TypedDecoder(TrajectoryGroup), {}
    garbage: dict[int, list[str]] = {}  # stream sequence of each garbage message -> the consumers that dead-lettered it
    for e in read_entries(run_dir, "dead-letter"):
        if not e.msg.original_subject.endswith(".traj"):
            continue
        try:
            g = groups.decode(e.msg.payload)
        except SchemaError:
            # One message may be dead-lettered more than once: a consumer that published the letter and was killed
            # before its +TERM landed gets the message again (a letter at least once, as any publish).
            garbage.setdefault(e.msg.stream_seq, []).append(e.msg.consumer)
            continue
        if g.producer_id == FORGER:
            reasons[g.task_id] = e.msg.reason[:160]
    ledger = read_ledger(run_dir)
    trained, reissued = set(ledger.trained), ledger.reissued
    named = [r["forged_in_flight"] for r in records if r.get("forged_in_flight")]
    never = [r["forged_never_released"] for r in records if r.get("forged_never_released")]
    return {"garbage_on_traj_dead_lettered": len(garbage),
            "garbage_dead_letters_by_stream_seq": {str(k): v for k, v in sorted(garbage.items())},
            "forged_groups_dead_lettered": {t: reasons.get(t, "NOT dead-lettered") for t in [*never, *named]},
            "named_real_prompts_trained_or_reissued": {t: t in trained or t in reissued for t in named}}  # fmt: skip


def _argv(pid: int) -> list[str]:
    from rlbus.bus.proc import command_line

    return command_line(pid)
