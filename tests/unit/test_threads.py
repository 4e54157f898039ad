"""Torch thread counts per process: the configured count wins, then OMP_NUM_THREADS, then the usable CPUs (affinity
and cgroup quota) split over the live rlbus processes of the machine-wide registry, re-checked as they come and go;
the roles' entry points really set them.

    .venv/bin/python -m pytest -q tests/unit/test_threads.py
"""

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlbus.common import threads
from rlbus.common.threads import (REGISTRY_ENV, Entry, Registry, affinity_cpus, auto_threads, cgroup_cpu_limit,
                                  choose_threads, process_start, share_of, usable_cpus)
from rlbus.schemas.config_io import load_config
from rlbus.schemas.errors import ConfigError


@pytest.mark.parametrize("cpus,procs,remainder,want", [
    (2, 3, False, 1),  # the quickstart on the 2-core machine: one thread each, not two each
    (2, 3, True, 1),
    (16, 3, False, 5),
    (16, 3, True, 6),  # the trainer's rank 0 takes what the even split leaves
    (1, 8, False, 1),  # never zero
    (8, 0, False, 8),  # no producers, one rank counted as one process
    (-3, 2, True, 1),  # explicit counts hold more than the CPUs: still one
])
def test_auto_split(cpus, procs, remainder, want):
    assert auto_threads(procs, cpus=cpus, takes_remainder=remainder) == want


def test_configured_count_wins_over_environment_and_auto():
    assert choose_threads(3, 3, cpus=2, environ={"OMP_NUM_THREADS": "1"}) == (3, "configured")


def test_omp_num_threads_wins_over_auto():
    assert choose_threads(0, 3, cpus=16, environ={"OMP_NUM_THREADS": "2"}) == (2, "OMP_NUM_THREADS")
    n, why = choose_threads(0, 3, cpus=16, environ={"OMP_NUM_THREADS": "junk"})
    assert (n, why.startswith("auto")) == (5, True)


def test_config_fields_default_to_auto_and_refuse_negatives():
    cfg = load_config(None, ["model.path=m"])
    assert (cfg.trainer.torch_threads, cfg.rollout.torch_threads) == (0, 0)
    with pytest.raises(ConfigError, match="torch_threads"):
        load_config(None, ["model.path=m", "trainer.torch_threads=-1"])
    with pytest.raises(ConfigError, match="torch_threads"):
        load_config(None, ["model.path=m", "rollout.torch_threads=-2"])


# -- usable CPUs: affinity and cgroup quota -------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_read_from_the_process_cgroup_and_its_parents(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/user.slice/run.scope\n")
    root = tmp_path / "fs"
    _write(root / "user.slice/run.scope/cpu.max", "max 100000\n")  # no limit on the process's own cgroup
    assert cgroup_cpu_limit(proc, root) is None
    _write(root / "user.slice/cpu.max", "150000 100000\n")  # a parent's limit binds it too
    assert cgroup_cpu_limit(proc, root) == 1.5
    _write(root / "user.slice/run.scope/cpu.max", "50000 100000\n")  # the tightest wins
    assert cgroup_cpu_limit(proc, root) == 0.5


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(proc, root) is None
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n")
    assert cgroup_cpu_limit(proc, root) == 3.0


def test_a_container_sees_its_cgroup_at_the_mount_root(tmp_path):
    """Without a cgroup namespace /proc/self/cgroup names the host's path, absent inside; the mount's root is the
    container's own cgroup."""
    proc = tmp_path / "cgroup"
    _write(proc, "0::/system.slice/docker-abc.scope\n")
    _write(tmp_path / "fs/cpu.max", "200000 100000\n")
    assert cgroup_cpu_limit(proc, tmp_path / "fs") == 2.0
    assert cgroup_cpu_limit(tmp_path / "missing", tmp_path / "fs") is None  # nothing to read: no limit known


def test_usable_cpus_are_the_affinity_mask_under_the_quota_rounded_up(monkeypatch):
    limit = cgroup_cpu_limit()
    assert usable_cpus() == max(1, min(len(os.sched_getaffinity(0)), math.ceil(limit) if limit else 10**6))
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 0.5)
    assert usable_cpus() == 1
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 1000.5)
    assert usable_cpus() == len(os.sched_getaffinity(0))


# -- the registry -----------------------------------------------------------------------------------------------------


@pytest.fixture
def other():
    """A live process that is not this one (its pid and start time make a real entry)."""
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def _entry(p: subprocess.Popen, **kw) -> Entry:
    return Entry(pid=p.pid, start=process_start(p.pid), role="other", **kw)


def test_process_start_tells_a_running_process_from_a_gone_or_zombie_one(tmp_path):
    assert process_start(os.getpid()) == process_start(os.getpid()) > 0
    p = subprocess.Popen(["true"])
    while process_start(p.pid) is not None:  # a zombie until reaped: already free
        time.sleep(0.01)
    p.wait()
    assert process_start(p.pid) is None
    _write(tmp_path / "7/stat", "7 (a) b) S 1 " + " ".join(["0"] * 17) + " 4242 0\n")  # ')' in the name
    assert process_start(7, tmp_path) == 4242
    _write(tmp_path / "8/stat", "8 (x) Z 1 " + " ".join(["0"] * 17) + " 4242 0\n")
    assert process_start(8, tmp_path) is None


def test_registry_counts_live_processes_and_drops_the_gone(tmp_path, other):
    reg = Registry(tmp_path / "reg")
    me = Entry(pid=os.getpid(), start=process_start(os.getpid()), role="me", cpus=frozenset({0, 1}))
    reg.register(me)
    reg.register(_entry(other, threads=3))
    gone = subprocess.Popen(["true"])
    gone.wait()
    reg.register(Entry(pid=gone.pid, start=12345, role="gone"))  # killed before it could remove its file
    reg.register(Entry(pid=other.pid, start=process_start(other.pid) - 1, role="pid reused"))
    (reg.path / f".{me.name}.tmp").write_text("{")  # someone's half-written file
    live = sorted(reg.live(), key=lambda e: e.role)
    assert live == sorted([me, _entry(other, threads=3)], key=lambda e: e.role)
    assert sorted(os.listdir(reg.path)) == sorted([me.name, _entry(other).name, f".{me.name}.tmp"])
    reg.unregister(me)
    assert [e.role for e in reg.live()] == ["other"]


def test_default_registry_is_private_per_user_or_chosen(tmp_path):
    reg = threads.default_registry({})
    st = reg.path.lstat()
    assert reg.path.name == f"rlbus-cpu-{os.getuid()}" and st.st_uid == os.getuid() and not st.st_mode & 0o077
    assert threads.default_registry({REGISTRY_ENV: str(tmp_path)}).path == tmp_path
    assert threads.default_registry({REGISTRY_ENV: "off"}) is None


# -- the split over the registry -------------------------------------------------------------------------------------


def _fake(pid: int, start: int, **kw) -> Entry:
    return Entry(pid=pid, start=start, role=f"p{pid}", **kw)


def test_share_splits_the_usable_cpus_over_the_live_processes():
    me = _fake(1, 100)
    assert share_of(me, [me], cpus=8)[0] == 8
    assert share_of(me, [me, _fake(2, 50), _fake(3, 60), _fake(4, 70)], cpus=8) == \
        (2, "auto: 8 CPU(s) over 4 rlbus process(es)")
    assert share_of(me, [me, _fake(2, 50)], cpus=8, num_processes=4)[0] == 2  # the run's own count is a floor
    assert share_of(me, [_fake(2, 50)] * 5, cpus=2)[0] == 1  # two runs on two cores: one each, never zero


def test_explicit_counts_hold_their_cpus_and_one_rank_0_takes_the_remainder():
    me = _fake(1, 100, remainder=True)
    assert share_of(me, [me, _fake(2, 50, threads=8), _fake(3, 60)], cpus=16)[0] == 4  # (16 - 8) / 2
    older_rank_0 = _fake(2, 50, remainder=True)
    assert share_of(me, [me, older_rank_0, _fake(3, 60)], cpus=16)[0] == 5  # 16 // 3, the older one takes the 1
    assert share_of(older_rank_0, [me, older_rank_0, _fake(3, 60)], cpus=16)[0] == 6


def test_processes_pinned_to_other_cpus_do_not_count():
    me = _fake(1, 100, cpus=frozenset({0, 1}))
    others = [_fake(2, 50, cpus=frozenset({2, 3})), _fake(3, 60, cpus=frozenset({1, 2})), _fake(4, 70)]
    assert share_of(me, [me, *others], cpus=2)[0] == 1  # 3 and 4 (mask unknown) share its CPUs
    assert share_of(me, [me, others[0]], cpus=2)[0] == 2


# -- this process: apply, refresh, scoped, executor threads --------------------------------------------------------


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """This test process's registry in tmp_path (never the machine's), on 4 usable CPUs; restored after."""
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "reg"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    before = torch.get_num_threads()
    yield Registry(tmp_path / "reg")
    threads.release()
    torch.set_num_threads(before)


def test_refresh_shrinks_when_another_process_registers_and_grows_back(registry, other, caplog):
    assert threads.apply_torch_threads(0, 1, role="probe") == 4 == torch.get_num_threads()
    assert [e.role for e in registry.live()] == ["probe"]
    registry.register(_entry(other))
    assert threads.refresh() == 4  # within REFRESH_EVERY_S of the last look: not looked at again
    caplog.set_level("INFO", logger="rlbus.threads")
    assert threads.refresh(every_s=0) == 2 == torch.get_num_threads()
    assert threads.refresh(every_s=0) == 2
    other.kill()
    other.wait()
    assert threads.refresh(every_s=0) == 4 == torch.get_num_threads()
    changes = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert changes == ["probe: 4 -> 2 torch thread(s) (auto: 4 CPU(s) over 2 rlbus process(es))",
                       "probe: 2 -> 4 torch thread(s) (auto: 4 CPU(s) over 1 rlbus process(es))"]  # once each
    threads.release()
    assert registry.live() == [] and threads.refresh(every_s=0) == 0  # unregistered: refresh changes nothing


def test_an_explicit_count_is_held_and_counted_by_the_others(registry, other, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.apply_torch_threads(0, 1, role="probe") == 3
    registry.register(_entry(other))
    assert threads.refresh(every_s=0) == 3
    assert [e.threads for e in registry.live() if e.role == "probe"] == [3]
    assert threads.apply_torch_threads(1, 1, role="probe") == 1  # a setting wins over the environment


def test_the_executor_threads_of_a_role_follow_the_share(registry, other):
    """Torch keeps the count per thread: a to_thread worker that ran before a change must still follow it."""

    async def role() -> list[int]:
        threads.refresh_executor_threads()
        seen = [await asyncio.to_thread(torch.get_num_threads)]
        registry.register(_entry(other))
        threads.refresh(every_s=0)  # on the loop's thread; the worker refreshes before its next call
        seen.append(await asyncio.to_thread(torch.get_num_threads))
        return seen

    threads.apply_torch_threads(0, 1, role="probe")
    assert asyncio.run(role()) == [4, 2]


def test_a_scoped_build_registers_capped_then_restores_the_process(registry, other):
    torch.set_num_threads(3)
    with threads.scoped_torch_threads(0, role="model build", cap=2) as n:
        assert n == 2 == torch.get_num_threads()
        assert [e.role for e in registry.live()] == ["model build"]
    assert registry.live() == [] and torch.get_num_threads() == 3  # a launcher that built the model: not counted
    threads.apply_torch_threads(0, 3, role="judge")
    registry.register(_entry(other))
    with threads.scoped_torch_threads(0, role="model build", cap=2) as n:
        assert n == 2  # 4 CPUs over 2 processes
    assert sorted(e.role for e in registry.live()) == ["judge", "other"]


def test_replay_holds_the_split_of_the_recorded_run(registry, other):
    registry.register(_entry(other))
    registry.register(Entry(pid=os.getppid(), start=process_start(os.getppid()), role="parent"))
    assert threads.apply_torch_threads(0, 1, role="replay", takes_remainder=True, adapt=False) == 4
    assert threads.refresh(every_s=0) == 4
    assert [e.threads for e in registry.live() if e.role == "replay"] == [4]


# -- real processes -------------------------------------------------------------------------------------------------


_PROBE = """
import json, sys, torch
from rlbus.common.threads import apply_torch_threads
n = apply_torch_threads(int(sys.argv[1]), int(sys.argv[2]), role="probe", takes_remainder=sys.argv[3] == "1")
print(json.dumps([n, torch.get_num_threads(), torch.get_num_interop_threads()]))
"""


def _env(registry_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, REGISTRY_ENV: str(registry_dir)}


@pytest.mark.parametrize("requested,procs,remainder", [(3, 3, "0"), (0, 1, "1")])
def test_apply_sets_the_pools_of_a_fresh_process(requested, procs, remainder, tmp_path):
    out = subprocess.run([sys.executable, "-c", _PROBE, str(requested), str(procs), remainder], env=_env(tmp_path),
                         capture_output=True, text=True, check=True, timeout=120).stdout
    n, intra, interop = json.loads(out.strip().splitlines()[-1])
    want = requested or usable_cpus()  # one process alone gets every CPU
    assert (n, intra, interop) == (want, want, 1)
    assert os.listdir(tmp_path) == []  # its entry went with it


_PEER = """
import json, sys
from rlbus.common import threads
print(json.dumps(threads.apply_torch_threads(0, 1, role=sys.argv[1])), flush=True)
for line in sys.stdin:
    if line.strip() != "look":
        break
    n = threads.refresh(every_s=0)
    print(json.dumps([len(threads.default_registry().live()), n]), flush=True)
"""


def _peer(name: str, env: dict[str, str]) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _PEER, name], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip(), f"peer {name} did not start"
    return p


def _look(p: subprocess.Popen) -> list[int]:
    p.stdin.write("look\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def test_two_processes_see_each_other_then_one_after_the_other_exits_or_is_killed(tmp_path):
    env, cpus = _env(tmp_path), usable_cpus()
    peers = []
    try:
        peers += [_peer("a", env), _peer("b", env)]
        a, b = peers
        assert _look(a) == [2, max(1, cpus // 2)] and _look(b) == [2, max(1, cpus // 2)]
        b.stdin.write("exit\n")
        b.stdin.flush()
        b.wait(timeout=60)
        assert _look(a) == [1, cpus]  # b removed its entry at exit
        peers.append(c := _peer("c", env))
        assert _look(a)[0] == 2
        c.kill()
        c.wait()
        assert _look(a) == [1, cpus]  # c left its entry behind: ignored, and deleted
        assert len(os.listdir(tmp_path)) == 1
    finally:
        for p in peers:
            p.kill()
            p.wait()


def test_available_cpus_follow_the_affinity_mask():
    assert affinity_cpus() == frozenset(os.sched_getaffinity(0))


_NICE_PROBE = """
import os, sys
from rlbus.common.threads import lower_priority
lower_priority(int(sys.argv[1]), role="probe")
print(os.getpriority(os.PRIO_PROCESS, 0))
"""


@pytest.mark.parametrize("nice", [0, 7])
def test_lower_priority_nices_a_fresh_process_by_that_much(nice):
    out = subprocess.run([sys.executable, "-c", _NICE_PROBE, str(nice)], capture_output=True, text=True, check=True,
                         timeout=60).stdout  # fmt: skip
    assert int(out.strip().splitlines()[-1]) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)


def test_producer_nice_is_refused_outside_0_to_19():
    assert load_config(None, ["model.path=m"]).rollout.nice == 0
    for bad in ("-1", "20"):
        with pytest.raises(ConfigError, match="rollout.nice"):
            load_config(None, ["model.path=m", f"rollout.nice={bad}"])
