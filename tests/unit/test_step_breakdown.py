"""The pipeline bench's step breakdown adds up: timed parts plus the unaccounted rest equal each step's wall time."""

import pytest

from bench.step_breakdown import PARTS, breakdown, breakdown_markdown, mean_parts, plot_compare, plot_run


def _row(step, wait, train, proximal=0.0, update=0.0, publish=0.01):
    return {"step": step, "time/wait_data": wait, "time/fetch": 0.02, "time/train": train,
            "timing/proximal_s": proximal, "timing/update_s": update, "time/publish_weights": publish}


def test_parts_sum_to_the_wall_time_between_rows():
    rows = [_row(1, 5.0, 1.0), _row(2, 0.1, 0.5, 0.2, 0.25), _row(3, 0.0, 0.4, 0.0, 0.3)]
    stamps = [10.0, 11.0, 11.6]
    parts = breakdown(rows, stamps)
    assert list(parts) == list(PARTS) and all(len(v) == 2 for v in parts.values())
    for i, wall in enumerate((1.0, 0.6)):
        assert sum(parts[p][i] for p in PARTS) == pytest.approx(wall)
    assert parts["rest of train"][0] == pytest.approx(0.05) and parts["proximal pass"][1] == 0.0
    assert parts["unaccounted"][0] == pytest.approx(1.0 - 0.1 - 0.02 - 0.5 - 0.01)
    assert mean_parts(parts, skip=1)["optimizer update"] == pytest.approx(0.3)


def test_figures_and_table_are_written(tmp_path):
    rows = [_row(s, 0.1, 0.5, 0.1, 0.3) for s in range(1, 6)]
    parts = breakdown(rows, [float(s) for s in range(5)])
    assert plot_run(parts, [2, 3, 4, 5], "t", tmp_path / "step_times.png").stat().st_size > 1000
    means = {"a": mean_parts(parts), "b": mean_parts(parts, skip=2)}
    assert plot_compare(means, "t", tmp_path / "cmp.png").stat().st_size > 1000

    class R:
        ok, workload, num_producers, mode, step_parts = True, "quickstart", 2, "async-1", means["a"]

    lines = breakdown_markdown([R()])
    assert any(line.startswith("| quickstart | 2 | async-1 | 0.100 |") for line in lines)
