"""bench/lora_accuracy.py: equal wall clock scores each side by the last model it had published by the shorter run's
last publish, and only a LoRA config of the same task is compared; bench/quickstart_seeds.py's runner stops a run
past its timeout and reports it."""

from __future__ import annotations

import pytest

from bench.common import appended
from bench.lora_accuracy import check_pair, compare, report, timeline
from rlbus.schemas.config_io import load_config


def _run(side: str, seed: int, step_s: float, accuracy: dict[int, float], rc: int = 0) -> dict:
    return {"side": side, "seed": seed, "rc": rc, "wall_s": 30 * step_s + 20,
            "saved": [{"step": s, "t": s * step_s, "accuracy": a} for s, a in sorted(accuracy.items())]}


def _results(*runs: dict) -> dict:
    return {"config": "configs/gcd_smollm2.yaml", "lora_config": "configs/gcd_lora_smollm2.yaml",
            "lora": "rank 16, alpha 32, LR 0.0002 against 2e-05", "overrides": [], "save_every": 10,
            "command": "python bench/lora_accuracy.py", "v0": {"eval/accuracy": 0.1},
            "machine": {"cpu_model": "cpu", "cores": 2, "load_avg_1m": 0.1}, "commit": "abc", "date": "2026-12-07",
            "runs": list(runs)}


def test_timeline_starts_at_version_0() -> None:
    assert timeline(_run("full", 0, 2.0, {10: 0.2, 30: 0.5}), 0.1) == [(0, 0.0, 0.1), (10, 20.0, 0.2),
                                                                         (30, 60.0, 0.5)]


def test_equal_wall_clock_is_the_shorter_runs_last_publish() -> None:
    d = _results(_run("full", 0, 3.0, {10: 0.2, 20: 0.3, 30: 0.4}),
                 _run("lora", 0, 2.0, {10: 0.15, 20: 0.25, 30: 0.35}),
                 _run("full", 1, 3.0, {10: 0.2}), _run("lora", 1, 2.0, {}, rc=1))
    (row,) = compare(d)  # seed 1's LoRA run failed: left out of the comparison, named in the report
    assert row["equal_s"] == 60.0  # LoRA's step 30 at 2 s a step
    assert row["lora_at"] == (30, 0.35) and row["full_at"] == (20, 0.3)  # full had step 20 (60 s), not 30 (90 s)
    text = report(d, [row])
    assert "+5.0 points" in text and "1.50x" in text and "lora seed 1: failed (exit 1)" in text


def test_appending_keeps_the_runs_and_refuses_another_comparison() -> None:
    old = {**_results(_run("full", 0, 3.0, {30: 0.4})), "note": "seed 0 only", "summary": {"diffs": [0.1]}}
    new = {**_results(), "command": "python bench/lora_accuracy.py --seeds 1 --append", "commit": "def"}
    pair = ("config", "lora_config", "overrides", "save_every")
    d = appended(old, new, same=pair, drop=("note", "summary"))
    assert d["runs"] == old["runs"] and "note" not in d and "summary" not in d
    assert d["more"] == [{"command": new["command"], "commit": "def", "machine": new["machine"], "date": new["date"]}]
    assert "More seeds: `python bench/lora_accuracy.py --seeds 1 --append` at `def`" in report(d, [])
    with pytest.raises(SystemExit, match="save_every 10"):
        appended(old, {**new, "save_every": 5}, same=pair)


def test_only_lora_and_the_learning_rate_may_differ() -> None:
    full, lora = load_config("configs/gcd_smollm2.yaml"), load_config("configs/gcd_lora_smollm2.yaml")
    check_pair(full, lora)  # the shipped pair: eval.interval differs too, and the bench turns it off
    with pytest.raises(SystemExit, match="trainer.total_steps"):
        check_pair(full, load_config("configs/gcd_lora_smollm2.yaml", ["trainer.total_steps=60"]))
    with pytest.raises(SystemExit, match="`rollout`"):
        check_pair(full, load_config("configs/gcd_lora_smollm2.yaml", ["rollout.n=4"]))
    with pytest.raises(SystemExit, match="must set model.lora"):
        check_pair(full, full)


def test_a_run_past_its_timeout_is_stopped_and_reported_not_raised() -> None:
    """bench/common.py's runner (every bench's `rlbus up` and TRL runs): a run past its timeout gets Ctrl-C, and the
    bench records it as timed out (exit 124) with what it printed, instead of losing every seed's results."""
    import sys
    import time

    from bench.common import TIMED_OUT, run_up

    t0 = time.monotonic()
    code = ("print('started', flush=True)\n"
            "try:\n    __import__('time').sleep(60)\nexcept KeyboardInterrupt:\n    print('got Ctrl-C')")
    rc, out = run_up([sys.executable, "-c", code], timeout=4.0)
    assert rc == TIMED_OUT and "started" in out and "got Ctrl-C" in out and "past its timeout of 4 s" in out
    assert time.monotonic() - t0 < 30


def test_a_run_gets_ctrl_c_even_when_the_bench_ignores_it() -> None:
    """A bench started with `&` from a script ignores SIGINT, and its children would inherit that."""
    import signal
    import sys

    from bench.common import TIMED_OUT, run_up

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = ("print('started', flush=True)\n"
                "try:\n    __import__('time').sleep(60)\nexcept KeyboardInterrupt:\n    print('got Ctrl-C')")
        rc, out = run_up([sys.executable, "-c", code], timeout=4.0)
    finally:
        signal.signal(signal.SIGINT, before)
    assert rc == TIMED_OUT and "got Ctrl-C" in out
