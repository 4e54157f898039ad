"""Faults injected from outside a real `rlbus up`, each run ending with the ledger check (tests/support/runs.py).

    .venv/bin/python -m pytest -q tests/system/test_faults.py

Only processes this test started are signalled, by pid: the launcher, and its trainer child found through /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.bus.proc import command_line, descendants
from rlbus.bus.proc import state as proc_state
from rlbus.consumers.ledger import read_ledger
from rlbus.trainer.metrics import read_metrics
from tests.support.runs import check_ledger, small_run_config, start_role, stop, wait_for_steps, write_config

pytestmark = pytest.mark.slow


def _children(launcher: subprocess.Popen, role: str, argv_index: int = 3) -> list[int]:
    """The live processes under the launcher whose argv[argv_index] names `role` (`python -m rlbus.cli ROLE`, which
    is also the title of a role forked from the fork server; or the nats-server binary)."""
    return [pid for pid in descendants(launcher.pid)
            if len(argv := command_line(pid)) > argv_index and argv[argv_index].endswith(role)]


def _child_running(launcher: subprocess.Popen, role: str, timeout: float = 60.0, argv_index: int = 3) -> int:
    """The pid of a live `role` process under the launcher (`_children`), waiting up to `timeout` for one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := _children(launcher, role, argv_index):
            return found[0]
        time.sleep(0.2)
    pytest.fail(f"no {role} under the launcher within {timeout}s")


def _up(tmp_path: Path, tiny_model_dir, run_name: str, total: int, **sections) -> tuple[Path, dict, Path]:
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "", **sections)
    cfg["trainer"].update(total_steps=total)
    return run_dir, cfg, write_config(tmp_path / "run.yaml", cfg)


def test_trainer_sigkilled_under_rlbus_up_is_restarted_and_the_run_finishes(tmp_path, tiny_model_dir, run_name):
    # Checkpoints at steps 20 and 40; the trainer dies after step 5 or a few more (steps take a fraction of a second
    # here). The launcher starts it again at once -- well inside JetStream's duplicate window -- it republishes
    # version 0, producers follow it down, and the steps since are redone. ack_wait is long (120 s): the groups the
    # dead trainer held unacked come back because the restarted one naks them (consumers/batcher.py `take_over`),
    # not because ack_wait ran out.
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 40, trainer={"checkpoint_interval": 20},
                                 rollout={"num_producers": 2}, bus={"ack_wait_s": 120.0})
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        trainer = _child_running(up, "trainer")
        wait_for_steps(run_dir, 5, [up], timeout=400)
        os.kill(trainer, signal.SIGKILL)  # our launcher's own child, by pid
        assert up.wait(timeout=600) == 0
    finally:
        stop(up, signal.SIGKILL)
    assert "trainer exited with code -9; restarting" in (tmp_path / "logs" / "up.log").read_text()
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert re.search(r"traj \(trainer\): [1-9]\d* delivery\(ies\) a predecessor held unsettled go back", log), log[-3000:]
    waited = re.search(r"(\d\d):(\d\d):(\d\d) INFO rlbus.trainer: resuming at step (\d+): waiting for [1-9]\d* group.*\n"
                       r"(?:.*\n)*?(\d\d):(\d\d):(\d\d) INFO rlbus.trainer: trainer up at step \4,", log)
    assert waited, log[-3000:]
    h0, m0, s0, _, h1, m1, s1 = map(int, waited.groups())
    assert (h1 * 3600 + m1 * 60 + s1 - h0 * 3600 - m0 * 60 - s0) % 86400 < 60, waited.group(0)  # not ack_wait's 120 s
    assert "did not come back" not in log
    check_ledger(run_dir, cfg)


def _age_s(pid: int) -> float:
    """Seconds since process `pid` started (/proc/PID/stat's start time against /proc/uptime)."""
    started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def _oldest_child(launcher: subprocess.Popen, role: str, min_age_s: float, timeout: float = 60.0) -> int:
    """The longest-running live `role` process under the launcher, once it has run `min_age_s`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ages = {}
        for pid in _children(launcher, role):
            with contextlib.suppress(OSError, IndexError, ValueError):  # it exited meanwhile
                ages[pid] = _age_s(pid)
        if ages and max(ages.values()) >= min_age_s:
            return max(ages, key=ages.__getitem__)
        time.sleep(0.2)
    pytest.fail(f"no {role} under the launcher had run {min_age_s}s within {timeout}s")


def test_producers_killed_again_and_again_do_not_stop_the_run(tmp_path, tiny_model_dir, run_name, fault_rng):
    # More kills than the launcher's start-failure budget: each producer dies after it got going, so every death
    # is a fault to ride out, not a role that cannot start. The victim is the producer that has run longest, once it
    # has run 3 s (a restarted one reports RoleStarted within about a second here), killed at a random moment after
    # that (seed printed: fault_rng). The kills pace themselves by the producers' restarts, not by the steps, and a
    # quiet machine makes 6-8 steps/s here: 250 steps were once done after 5 kills of 7, so the run is 500 steps
    # (the seventh kill comes within about 30 s of the first step, quiet or busy).
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 500, rollout={"num_producers": 2})
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    kills = 0
    try:
        wait_for_steps(run_dir, 1, [up], timeout=400)
        while kills < 7 and up.poll() is None:
            victim = _oldest_child(up, "producer", min_age_s=3.0)
            time.sleep(fault_rng.uniform(0.0, 2.0))  # a random moment of its work
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it had gone meanwhile (restarted by the launcher): pick a live one
            kills += 1
        assert up.wait(timeout=600) == 0
    finally:
        stop(up, signal.SIGKILL)
    assert kills == 7, f"the run ended after {kills} kills"
    restarts = re.findall(r"producer-\d exited with code -9; restarting", (tmp_path / "logs" / "up.log").read_text())
    assert len(restarts) == 7, restarts
    check_ledger(run_dir, cfg)


def test_a_producer_killed_holding_a_task_gets_it_back_when_restarted_not_after_ack_wait(tmp_path, tiny_model_dir,
                                                                                        run_name):
    # One producer with slow rollouts (about 3 s a task) and ack_wait 120 s: killed while it rolls a task out, it is
    # restarted under its id by `rlbus up` and naks what its predecessor held (bus/handover.py); the task is rolled
    # out again (delivery 2) well before ack_wait would have handed it out.
    engine = {"type": "simulated", "mean_tokens": 16, "tail_alpha": 3.0, "seconds_per_token": 0.2}
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 6, bus={"ack_wait_s": 120.0},
                                 rollout={"num_producers": 1, "agent_loop": "single_turn", "engine": engine})
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    log = run_dir / "logs" / "producer-0.log"
    try:
        wait_for_steps(run_dir, 1, [up], timeout=400)
        victim = _child_running(up, "producer")
        deadline = time.monotonic() + 120
        while not _unfinished(log.read_text()):
            assert time.monotonic() < deadline and up.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        os.kill(victim, signal.SIGKILL)  # our launcher's own child, by pid
        killed = time.monotonic()
        held = _unfinished(log.read_text())  # its incarnation's log is complete now
        assert held
        again = re.compile(rf"task ({'|'.join(map(re.escape, held))}): rolling out \(delivery 2\)")
        while not again.search(log.read_text()):
            assert time.monotonic() - killed < 60, log.read_text()[-3000:]  # ack_wait would take 120 s
            time.sleep(0.2)
        assert "a predecessor held unsettled go back" in log.read_text()
        assert up.wait(timeout=600) == 0
    finally:
        stop(up, signal.SIGKILL)
    check_ledger(run_dir, cfg)


def _unfinished(log: str) -> list[str]:
    """Tasks a producer's log shows begun (delivery 1) and not done."""
    begun = re.findall(r"task (\S+): rolling out \(delivery 1\)", log)
    return [t for t in begun if f"task {t}: done" not in log and f"task {t} abandoned" not in log]


def test_a_producer_stopped_past_ack_wait_has_its_task_redelivered_and_catches_up_when_woken(tmp_path, tiny_model_dir,
                                                                                            run_name, fault_rng):
    # SIGSTOP a producer for longer than ack_wait (8 s here) and than weight_versions_kept versions: its task goes to
    # the other producer; woken, it finds its versions evicted, jumps to the newest weights and works on; the
    # group it finishes late is either trained or dropped as too stale -- never trained twice.
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 80, rollout={"num_producers": 2},
                                 ray={"weight_versions_kept": 2})
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        wait_for_steps(run_dir, 2, [up], timeout=400)
        victim = _child_running(up, "producer")
        time.sleep(fault_rng.uniform(0.5, 3.0))
        os.kill(victim, signal.SIGSTOP)  # our launcher's own child, by pid
        try:
            stopped_at = read_metrics(run_dir)[-1]["step"]
            time.sleep(cfg["bus"]["ack_wait_s"] + 2.0)  # past ack_wait
            went_on = read_metrics(run_dir)[-1]["step"] - stopped_at
        finally:
            os.kill(victim, signal.SIGCONT)
        assert went_on > 2, "the run did not go on without the stopped producer"  # > weight_versions_kept too
        assert up.poll() is None, "the run ended before the producer woke: make it longer"
        assert up.wait(timeout=600) == 0
        assert proc_state(victim) == "gone"  # it drained and stopped with the run, not crashed and restarted
    finally:
        stop(up, signal.SIGKILL)
    log = (tmp_path / "logs" / "up.log").read_text()
    assert re.search(r"producer-\d exited with code -?\d+; restarting", log) is None, log[-3000:]
    check_ledger(run_dir, cfg)


def test_ray_head_sigkilled_mid_run_is_restarted_with_every_role(tmp_path, tiny_model_dir, run_name):
    # The whole head (its process group: GCS, raylet, the TransferQueue and weight-store actors) dies. The launcher
    # stops every role, starts a new head and the roles again; the trainer resumes from its checkpoint and the
    # groups whose payloads were lost are re-issued.
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 60, trainer={"checkpoint_interval": 3},
                                 rollout={"num_producers": 2})
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        head = _child_running(up, "rlbus.bus.ray_start", argv_index=2)  # `python -m rlbus.bus.ray_start start --head`
        wait_for_steps(run_dir, 4, [up], timeout=400)
        os.killpg(head, signal.SIGKILL)  # our launcher's own child's process group, by its pid
        assert up.wait(timeout=900) == 0
    finally:
        stop(up, signal.SIGKILL)
    assert "Ray head exited" in (tmp_path / "logs" / "up.log").read_text()
    check_ledger(run_dir, cfg)


def test_embedded_nats_server_sigkilled_mid_run_is_restarted(tmp_path, tiny_model_dir, run_name):
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 8, trainer={"checkpoint_interval": 2},
                                 rollout={"num_producers": 2})
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        server = _child_running(up, "nats-server", argv_index=0)
        wait_for_steps(run_dir, 3, [up], timeout=400)
        os.kill(server, signal.SIGKILL)
        assert up.wait(timeout=600) == 0
    finally:
        stop(up, signal.SIGKILL)
    assert "nats-server exited; restarting" in (tmp_path / "logs" / "up.log").read_text()
    check_ledger(run_dir, cfg)


def test_a_prompt_producers_keep_failing_is_dead_lettered_reissued_then_given_up_by_name(tmp_path, tiny_model_dir,
                                                                                         run_name, monkeypatch):
    # A reward service that refuses one prompt: every producer fails that task, the last delivery dead-letters it
    # (terminated: no max-deliveries advisory fires), the feeder releases it again from the dead letters, and
    # after feeder.max_attempts releases it is given up -- each step of that named in the ledger.
    (tmp_path / "refusing_reward.py").write_text(  # refuses example 0: the first released, with shuffle off
        "def reward(response, ground_truth, *, task):\n"
        "    if task.index == 0:\n"
        "        raise RuntimeError('the reward service refuses this prompt')\n"
        "    return 1.0 if response.strip().startswith(str(ground_truth)) else 0.0\n")
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 30, bus={"max_deliver": 2},
                                 rollout={"num_producers": 2, "reward": "refusing_reward:reward"},
                                 feeder={"max_attempts": 2, "shuffle": False})
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the launcher's children import the user's reward from here
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        assert up.wait(timeout=900) == 0
    finally:
        stop(up, signal.SIGKILL)
    check_ledger(run_dir, cfg)
    ledger = read_ledger(run_dir)
    assert {"e0-i0-a0", "e0-i0-a1"} <= ledger.dead_lettered
    assert "e0-i0-a0" in ledger.reissued and ledger.given_up == {"e0-i0-a1"}
    assert "e0-i0-a0" not in ledger.trained and "e0-i0-a1" not in ledger.trained


def test_rlbus_up_sigkilled_leaves_nothing_behind_and_the_same_command_resumes(tmp_path, tiny_model_dir, run_name):
    # The launcher itself dies: its children (trainer, producers, the embedded nats-server) stop with it rather
    # than linger holding the run's store, and `rlbus up` again picks the run up from its checkpoint.
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 12, trainer={"checkpoint_interval": 3},
                                 rollout={"num_producers": 2})
    first = start_role("up", cfg_path, tmp_path / "logs", name="up-1")
    try:
        children = [_child_running(first, role) for role in ("trainer", "producer")]
        children.append(_child_running(first, "nats-server", argv_index=0))
        wait_for_steps(run_dir, 4, [first], timeout=400)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        stop(first, signal.SIGKILL)
    # They shut down as on a Ctrl-C (the trainer checkpoints, producers give tasks back); with the bus and Ray gone
    # too, their bounded retries take a while. The same command, run at once, waits for them (the run directory's
    # lock, cli/run_lock.py) instead of racing them for the run's checkpoints and streams.
    assert any(proc_state(pid) not in ("Z", "gone") for pid in children), "nothing to wait for"
    second = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", str(cfg_path)], capture_output=True,
                            text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-4000:] + second.stdout[-4000:]
    assert "waiting for the roles of an earlier rlbus up" in second.stderr + second.stdout
    assert not [p for p in children if proc_state(p) not in ("Z", "gone")], "left behind"
    check_ledger(run_dir, cfg)


async def _kill_after_a_delivery(launcher: subprocess.Popen, admin: Path, run: str) -> tuple[int, float]:
    """SIGKILL the launcher's nats-server at once after the prompts consumer next delivers (read by polling its
    consumer info, a millisecond apart); (that delivery's stream sequence, monotonic time of the kill)."""
    import nats

    from rlbus.bus.auth import load_creds
    from rlbus.schemas.subjects import Subjects

    creds, s = load_creds(admin), Subjects.for_run(run)
    server = _child_running(launcher, "nats-server", argv_index=0)  # the launcher's own child, found before: fast
    nc = await nats.connect(creds["url"], user=creds["user"], password=creds["password"],
                            inbox_prefix=creds["inbox_prefix"], connect_timeout=5)  # fmt: skip
    try:
        js = nc.jetstream(timeout=5)
        first = (await js.consumer_info(s.prompts_stream, s.prompts_consumer)).delivered.stream_seq
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            seq = (await js.consumer_info(s.prompts_stream, s.prompts_consumer)).delivered.stream_seq
            if seq > first:
                os.kill(server, signal.SIGKILL)
                return seq, time.monotonic()
        pytest.fail(f"no prompt delivered within 120 s (rlbus up exit code: {launcher.poll()})")
    finally:
        await nc.close()


def _redone_as_new(producer_log: str) -> list[str]:
    """Tasks a producer's log shows rolled out twice as delivery 1: a delivery the server lost (a restarted
    server hands the message out again as new; a nak or ack_wait redelivers it as delivery 2 and up)."""
    begun = re.findall(r"task (\S+): rolling out \(delivery 1\)", producer_log)
    return sorted({t for t in begun if begun.count(t) > 1})


def _lost_a_delivery(producer_log: Path, before: str, up: subprocess.Popen, wait_s: float = 10.0) -> bool:
    """Whether the producer's log since `before` shows a delivery the restarted server lost: a task redone as
    delivery 1, or a settle given up or retried (the old code's first retry came after its 5 s timeout)."""
    settle = re.compile(r"(\+ACK|-NAK|\+TERM) of \S+ seq \d+ \(producers\)(: the server no longer knows|: .*retrying| failed)")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and up.poll() is None:
        log = producer_log.read_text()
        if _redone_as_new(log) != _redone_as_new(before) or settle.search(log, len(before)):
            return True
        time.sleep(0.5)
    return False


def _first_outcome(producer_log: str, task: str) -> str:
    """The line that ends the first rollout of `task` in a producer's log (done, failed or abandoned)."""
    begun = producer_log.index(f"task {task}: rolling out")
    m = re.compile(rf".*task {re.escape(task)}(: done in| failed| abandoned).*").search(producer_log, begun)
    return m[0] if m else ""


def _longest_gap(run_dir: Path, since: float, steps: int, timeout: float = 300.0) -> float:
    """The longest time without a new step from `since` (monotonic) until `steps` more steps were written
    (metrics.jsonl polled every 0.1 s)."""
    start = len(read_metrics(run_dir))
    seen, last = [since], start
    deadline = time.monotonic() + timeout
    while last < start + steps:
        assert time.monotonic() < deadline, f"{last - start} of {steps} steps within {timeout:.0f}s"
        time.sleep(0.1)
        if (n := len(read_metrics(run_dir))) > last:
            seen.append(time.monotonic())
            last = n
    return max(b - a for a, b in zip(seen, seen[1:]))


def test_a_task_delivered_just_before_a_nats_server_sigkill_is_settled_at_once_after_the_restart(
        tmp_path, tiny_model_dir, run_name):
    # Issue 42: the embedded server is SIGKILLed right after it delivered a prompt task (the producer's ack of its
    # last task and its fetch of the next come back to back, and the server stores a consumer change made within
    # ~0.1 s of the previous one only later). The restarted server does not know that delivery; the producer's ack
    # after its rollout got no answer for bus.retry_s -- one producer, one task at a time, so nobody else fetched the
    # task meanwhile -- and the task failed ("+ACK ... failed for 30s (6 attempts)", as in the issue). Now the ack is
    # given up at once and the task is redelivered; the redo's group is a duplicate the publish drops (its
    # Nats-Msg-Id), and the ledger stays clean: every prompt trained once. A wide admission bound keeps tasks
    # queued, so the producer's fetch follows its ack at once (and the trainer has groups to go on with meanwhile).
    run_dir, cfg, cfg_path = _up(tmp_path, tiny_model_dir, run_name, 100,  # long enough for 4 tries
                                 trainer={"checkpoint_interval": 2, "max_staleness": 4},
                                 rollout={"num_producers": 1, "max_inflight_tasks": 1}, bus={"ack_wait_s": 15.0})
    admin = run_dir / "bus" / "creds" / run_name / "admin.json"
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        wait_for_steps(run_dir, 3, [up], timeout=400)
        producer_log = run_dir / "logs" / "producer-0.log"
        for _ in range(4):  # until a kill lost a delivery (the first did, in nearly every run so far)
            before = producer_log.read_text()
            seq, killed_at = asyncio.run(_kill_after_a_delivery(up, admin, run_name))
            gap = _longest_gap(run_dir, killed_at, steps=4)
            print(f"nats-server killed after delivering seq {seq}: {gap:.1f}s without a step until 4 steps later")
            if _lost_a_delivery(producer_log, before, up):
                break
        else:
            pytest.fail("no kill lost a delivery: the test could not show the settle")
        assert up.wait(timeout=600) == 0
    finally:
        stop(up, signal.SIGKILL)
    log = producer_log.read_text()
    lost = sorted(set(_redone_as_new(log)) - set(_redone_as_new(before)))
    assert lost, log[-3000:]
    # The first delivery of a lost task was rolled out, published and its ack given up in about a second, not
    # failed after bus.retry_s; the ack the restarted server could not place is named as given up.
    outcome = _first_outcome(log, lost[0])
    took = re.search(r": done in ([\d.]+)s", outcome)
    assert took and float(took[1]) < 5.0, f"the task the server lost: {outcome!r}"
    given_up = re.findall(r"\+ACK of \S+ seq (\d+) \(producers\): the server no longer knows this delivery", log)
    assert any(int(s) >= seq for s in given_up), log[-3000:]
    assert gap < 12.0, f"{gap:.1f}s without a step after the kill"
    check_ledger(run_dir, cfg)
