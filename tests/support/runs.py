"""Helpers for system tests that run rlbus roles as real OS processes (`python -m rlbus.cli ...`).

    proc = start_role("trainer", cfg_path, log_dir)     # its own session; stopped by pid only
    wait_for_steps(run_dir, 3, procs=[proc])

A tiny model for these tests comes from `tiny_model_dir` (session scope): the quickstart's tokenizer and model
architecture with a very short warm start, so generation is cheap and produces real structure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from rlbus.consumers.ledger import admission_bound, read_ledger
from rlbus.schemas.config_io import load_config
from rlbus.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlbus.common.model.init_model import init_model
    from rlbus.common.model.tiny import TinyModelSpec

    out = tmp_path_factory.mktemp("models") / "tiny"
    # Wider and deeper than the quickstart's model, so that generation, not the trainer, bounds a test run's
    # throughput (what adding a producer is supposed to raise) and steps are slow enough to land signals between.
    spec = TinyModelSpec(hidden_size=128, intermediate_size=384, num_hidden_layers=4)
    init_model(out, steps=30, check_target=0, num_threads=1, spec=spec, log=lambda *_: None)  # short: no copy to check
    return out


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def small_run_config(name: str, run_dir: Path, model_dir: Path, bus_url: str, creds_file: str, ray_address: str,
                     **sections: dict[str, Any]) -> dict[str, Any]:
    """A run config sized for tests: tiny groups, short turns, frequent heartbeats, short ack_wait."""
    cfg: dict[str, Any] = {
        "name": name,
        "bus": {"url": bus_url, "creds_file": creds_file, "ack_wait_s": 8.0},
        "ray": {"address": ray_address, "num_storage_actors": 1, "capacity_bytes": 256 * 1024**2},
        "model": {"path": str(model_dir)},
        "data": {"type": "synthetic", "num_examples": 256},
        "rollout": {"n": 2, "max_new_tokens": 16, "max_response_tokens": 40, "max_turns": 2,
                    "max_tool_response_tokens": 8, "heartbeat_interval_s": 1.0, "in_progress_interval_s": 2.0,
                    "engine": {"type": "hf", "max_batch_size": 4}},
        "trainer": {"total_steps": 6, "groups_per_step": 2, "max_staleness": 1, "checkpoint_interval": 2,
                    "micro_batch_size": 4, "lr": 1e-4},
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "plot": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def run_up(tmp_path: Path, cfg: dict[str, Any], timeout: float = 900) -> Path:
    """`rlbus up` of `cfg` (written to tmp_path/run.yaml) to the end; it must exit 0 (else its log's tail fails the
    test). Returns the config's path."""
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        assert up.wait(timeout=timeout) == 0, (tmp_path / "logs" / "up.log").read_text()[-4000:]
    finally:
        stop(up, signal.SIGKILL)
    return cfg_path


def start_role(role: str, cfg_path: Path, log_dir: Path, *extra: str, name: str | None = None,
               creds: dict[str, str] | None = None) -> subprocess.Popen:
    """`rlbus <role> CONFIG ...` as its own process; with `creds` (tests.support.nats_server.run_creds) it gets only
    its role's credential, as `rlbus up` hands them out."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if creds is not None:  # an override, so before the flags
        extra = (f"bus.creds_file={creds[role]}", *extra)
    log = open(log_dir / f"{name or role}.log", "ab")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", role, str(cfg_path), *extra], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.log_path = log_dir / f"{name or role}.log"  # type: ignore[attr-defined]
    return proc


def files_holding(roots: list[Path], secrets: list[str], skip: set[Path] = frozenset()) -> list[str]:
    """Every file under `roots` (but `skip`) whose bytes contain one of `secrets`: "path: which"."""
    found = []
    for root in roots:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and p not in skip):
            data = path.read_bytes()
            found += [f"{path}: {s[:4]}..." for s in secrets if s.encode() in data]
    return found


def log_tail(proc: subprocess.Popen, lines: int = 60) -> str:
    path: Path = proc.log_path  # type: ignore[attr-defined]
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def wait_for_steps(run_dir: Path, steps: int, procs: list[subprocess.Popen], timeout: float = 300.0,
                   poll: float = 0.5) -> list[dict]:
    """Wait until metrics.jsonl reaches `steps`; fail early (with logs) if a watched process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_metrics(run_dir)
        if rows and rows[-1]["step"] >= steps:
            return rows
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"{p.args[3]} exited with {p.returncode} before step {steps}:\n{log_tail(p)}")
        time.sleep(poll)
    pytest.fail(f"no step {steps} within {timeout}s; logs:\n" + "\n---\n".join(log_tail(p) for p in procs))


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.args[3]} did not exit within {timeout}s:\n{log_tail(proc)}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
    """Signal a process we started (by pid) and reap it; SIGKILL if it does not go within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture
def fault_rng(request: pytest.FixtureRequest) -> random.Random:
    """Randomness for when and where a fault test strikes; the seed is printed (shown with a failure) and
    `RLBUS_FAULT_SEED=<seed>` replays the same choices."""
    seed = int(os.environ.get("RLBUS_FAULT_SEED") or random.SystemRandom().randrange(2**32))
    print(f"fault seed {seed}: RLBUS_FAULT_SEED={seed} reproduces this test's choices")
    request.node.user_properties.append(("fault_seed", seed))
    return random.Random(seed)


@pytest.fixture
def role_processes() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts; whatever is still running at the end is killed (by pid)."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def check_ledger(run_dir: Path, cfg: dict) -> None:
    """Every step trained once, versions following steps, every released prompt accounted for -- read from the
    run directory and from `rlbus events RUN_DIR --ledger --json`, as a user checks a run."""
    total, groups_per_step = cfg["trainer"]["total_steps"], cfg["trainer"]["groups_per_step"]
    rows = [r for r in read_metrics(run_dir) if "eval/accuracy" not in r]  # the evaluator's rows are its own
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert [r["version"] for r in rows] == list(range(1, total + 1))  # versions follow the checkpoint
    ledger = read_ledger(run_dir)
    assert len(ledger.trained) == total * groups_per_step
    assert ledger.problems(admission_bound(load_config(run_dir / "config.yaml"))) == [], ledger.counts()
    # and the same from the command line, as a user checks a run
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "events", str(run_dir), "--ledger", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = json.loads(proc.stdout)
    assert said["trained"] == total * groups_per_step and said["problems"] == []
