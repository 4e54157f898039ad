"""bench/lora_accuracy.py: a version's time is its trainer's steps and waits summed, and equal wall clock scores
each side by the last version it had evaluated by the shorter run's end; the runner of the runs it reads
(bench/quickstart_seeds.py's) stops a run past its timeout and reports it."""

from __future__ import annotations

import pytest

from bench.lora_accuracy import compare, report, timeline


def _run(seed: int, step_s: float, accuracy: dict[int, float]) -> dict:
    return {"seed": seed, "rc": 0, "train": [{"step": i + 1, "reward": 0.0, "step_s": step_s - 0.5, "wait_s": 0.5}
                                       for i in range(30)],
            "eval": [{"version": v, "accuracy": a} for v, a in sorted(accuracy.items())]}


def _results(config: str, *runs: dict) -> dict:
    return {"config": config, "overrides": [], "machine": {"cpu_model": "cpu", "cores": 2, "load_avg_1m": 0.1},
            "commit": "abc", "date": "2026-12-06", "results": f"bench/results/{config}.json", "runs": list(runs)}


def test_timeline_sums_steps_and_waits_up_to_each_version() -> None:
    assert timeline(_run(0, 2.0, {0: 0.1, 10: 0.2, 30: 0.5})) == [(0, 0.0, 0.1), (10, 20.0, 0.2), (30, 60.0, 0.5)]


def test_equal_wall_clock_is_the_shorter_runs_end() -> None:
    full = _results("full", _run(0, 3.0, {0: 0.1, 10: 0.2, 20: 0.3, 30: 0.4}), _run(1, 3.0, {0: 0.1}))
    lora = _results("lora", _run(0, 2.0, {0: 0.1, 10: 0.15, 20: 0.25, 30: 0.35}))
    (row,) = compare(full, lora)  # seed 1 has no LoRA run: left out
    assert row["equal_s"] == 60.0  # LoRA's 30 steps of 2 s
    assert row["lora_at"] == (30, 0.35) and row["full_at"] == (20, 0.3)  # full had reached v20 (60 s), not v30 (90 s)
    text = report(full, lora, [row], "python bench/lora_accuracy.py a b")
    assert "+5.0 points" in text and "1.50x" in text


def test_runs_without_waits_are_refused() -> None:
    run = _run(0, 2.0, {0: 0.1})
    del run["train"][3]["wait_s"]
    with pytest.raises(SystemExit, match="wait_s"):
        timeline(run)


def test_a_run_past_its_timeout_is_stopped_and_reported_not_raised() -> None:
    """bench/quickstart_seeds.py's runner (bench/env_task.py's too): a run past its timeout gets Ctrl-C, and the
    bench records it as timed out (exit 124) with what it printed, instead of losing every seed's results."""
    import sys
    import time

    from bench.quickstart_seeds import TIMED_OUT, _run_up

    t0 = time.monotonic()
    code = ("print('started', flush=True)\n"
            "try:\n    __import__('time').sleep(60)\nexcept KeyboardInterrupt:\n    print('stopped')")
    rc, out = _run_up([sys.executable, "-c", code], timeout=2.0)
    assert rc == TIMED_OUT and "started" in out and "stopped" in out and "past its timeout of 2 s" in out
    assert time.monotonic() - t0 < 30
