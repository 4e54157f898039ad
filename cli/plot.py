"""Curves of a run: reward (and the held-out eval accuracy), staleness, the behaviour/proximal mismatch and throughput
against step, from `<run_dir>/metrics.jsonl`.

    rlbus plot runs/quickstart            # writes runs/quickstart/curves.png
"""

from __future__ import annotations

from pathlib import Path

from rlbus.trainer.metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display here
    import matplotlib.pyplot as plt


    run_dir = Path(run_dir)
    every = read_metrics(run_dir)
    # The evaluator's scores are rows of their own (eval/*, at the step of the version scored).
    evals = [r for r in every if "eval/accuracy" in r]
    rows = [r for r in every if "eval/accuracy" not in r]
    if not rows:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} holds no steps to plot")
    steps = [r["step"] for r in rows]

    def series(key: str) -> list[float]:
        return [float(r.get(key) if r.get(key) is not None else "nan") for r in rows]

    fig, axes = plt.subplots(1, 4, figsize=(20, 4), constrained_layout=True)
    ax = axes[0]
    ax.plot(steps, series("reward/mean"), marker="o", ms=3, label="reward/mean")
    mean, std = series("reward/mean"), series("reward/std")
    low = [max(m - s, 0.0) for m, s in zip(mean, std)]  # rewards live in [0, 1]: clip the +-std band there
    high = [min(m + s, 1.0) for m, s in zip(mean, std)]
    ax.fill_between(steps, low, high, alpha=0.2, label="+-1 std (clipped)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], marker="s", color="tab:red",
                label=f"eval/accuracy (held-out, {evals[-1].get('eval/num_prompts', '?')} prompts)")
    ax.set(title="reward", xlabel="step", ylim=(-0.05, 1.05))
    ax.legend(loc="lower right")
    ax = axes[1]
    ax.plot(steps, series("staleness/mean"), label="mean")
    ax.plot(steps, series("staleness/max"), label="max", linestyle="--")
    ax.set(title="staleness (versions)", xlabel="step")
    ax.legend()
    ax = axes[2]
    ax.plot(steps, series("mismatch/kl_k3"), color="tab:purple")
    ax.set(title="mismatch KL(behaviour || proximal), k3", xlabel="step")
    ax = axes[3]
    ax.plot(steps, series("perf/tokens_per_s"), color="tab:green")
    ax.set(title="trainer tokens / s", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
