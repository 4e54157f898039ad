"""Torch thread counts per process: the configured count wins, then OMP_NUM_THREADS, then the CPUs split over the
run's processes; the roles' entry points really set them."""

import json
import os
import subprocess
import sys

import pytest

from rlbus.common.threads import auto_threads, available_cpus, choose_threads
from rlbus.schemas.config_io import load_config
from rlbus.schemas.errors import ConfigError


@pytest.mark.parametrize("cpus,procs,remainder,want", [
    (2, 3, False, 1),  # the quickstart on the 2-core machine: one thread each, not two each
    (2, 3, True, 1),
    (16, 3, False, 5),
    (16, 3, True, 6),  # the trainer's rank 0 takes what the even split leaves
    (1, 8, False, 1),  # never zero
    (8, 0, False, 8),  # no producers, one rank counted as one process
])
def test_auto_split(cpus, procs, remainder, want):
    assert auto_threads(procs, cpus=cpus, takes_remainder=remainder) == want


def test_configured_count_wins_over_environment_and_auto():
    assert choose_threads(3, 3, cpus=2, environ={"OMP_NUM_THREADS": "1"}) == (3, "configured")


def test_omp_num_threads_wins_over_auto():
    assert choose_threads(0, 3, cpus=16, environ={"OMP_NUM_THREADS": "2"}) == (2, "OMP_NUM_THREADS")
    n, why = choose_threads(0, 3, cpus=16, environ={"OMP_NUM_THREADS": "junk"})
    assert (n, why.startswith("auto")) == (5, True)


def test_available_cpus_follows_the_affinity_mask():
    assert available_cpus() == len(os.sched_getaffinity(0))


def test_config_fields_default_to_auto_and_refuse_negatives():
    cfg = load_config(None, ["model.path=m"])
    assert (cfg.trainer.torch_threads, cfg.rollout.torch_threads) == (0, 0)
    with pytest.raises(ConfigError, match="torch_threads"):
        load_config(None, ["model.path=m", "trainer.torch_threads=-1"])
    with pytest.raises(ConfigError, match="torch_threads"):
        load_config(None, ["model.path=m", "rollout.torch_threads=-2"])


_PROBE = """
import json, sys, torch
from rlbus.common.threads import apply_torch_threads
n = apply_torch_threads(int(sys.argv[1]), int(sys.argv[2]), role="probe", takes_remainder=sys.argv[3] == "1")
print(json.dumps([n, torch.get_num_threads(), torch.get_num_interop_threads()]))
"""


@pytest.mark.parametrize("requested,procs,remainder", [(3, 3, "0"), (0, 1, "1")])
def test_apply_sets_the_pools_of_a_fresh_process(requested, procs, remainder):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(requested), str(procs), remainder], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    n, intra, interop = json.loads(out.strip().splitlines()[-1])
    want = requested or len(os.sched_getaffinity(0))  # one process alone gets every CPU
    assert (n, intra, interop) == (want, want, 1)


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
