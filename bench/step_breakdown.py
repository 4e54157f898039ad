"""Where a trainer step's wall time goes, from a run's metrics rows and the wall-clock stamps of their arrival.

Used by bench/pipeline.py: one stacked-bar figure per run (`RUN_DIR/step_times.png`: each step's wall time split
into waiting for data, fetch, proximal pass, optimizer update, the rest of train_step, weight publish, and what no
timer covers) and one figure comparing runs (their mean step, same split).

    parts = breakdown(rows, stamps)        # {part: [seconds per step]}, parts in PARTS order
"""

from __future__ import annotations

from pathlib import Path

#: (label, how a row gives it). "unaccounted" = the step's wall time (stamp to stamp) less every timed part: the
#: controller's bookkeeping between steps (metrics, events, feeder, checkpoints) and the metrics file's polling.
PARTS = ("wait for data", "fetch", "proximal pass", "optimizer update", "rest of train", "record",
         "publish weights", "unaccounted")
COLORS = ("#bbbbbb", "#8c564b", "#ff7f0e", "#1f77b4", "#17becf", "#e377c2", "#2ca02c", "#d62728")


def row_parts(row: dict) -> dict[str, float]:
    """The timed parts of one metrics row (seconds); 'rest of train' is time/train less its timed sub-parts."""
    g = lambda k: float(row.get(k) or 0.0)
    proximal, update = g("timing/proximal_s"), g("timing/update_s")
    return {
        "wait for data": g("time/wait_data"),
        "fetch": g("time/fetch"),
        "proximal pass": proximal,
        "optimizer update": update,
        "rest of train": max(0.0, g("time/train") - proximal - update),
        "record": g("time/record"),
        "publish weights": g("time/publish_weights"),
    }


def breakdown(rows: list[dict], stamps: list[float]) -> dict[str, list[float]]:
    """Per step (from the second row: the first has no previous stamp), seconds of each part of PARTS."""
    out: dict[str, list[float]] = {p: [] for p in PARTS}
    for i in range(1, len(rows)):
        parts = row_parts(rows[i])
        wall = stamps[i] - stamps[i - 1]
        parts["unaccounted"] = max(0.0, wall - sum(parts.values()))
        for p in PARTS:
            out[p].append(parts[p])
    return out


def mean_parts(parts: dict[str, list[float]], skip: int = 0) -> dict[str, float]:
    return {p: (sum(v[skip:]) / len(v[skip:]) if v[skip:] else 0.0) for p, v in parts.items()}


def plot_run(parts: dict[str, list[float]], steps: list[int], title: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
    bottom = [0.0] * len(steps)
    for p, color in zip(PARTS, COLORS):
        ax.bar(steps, parts[p], bottom=bottom, color=color, label=p, width=0.8)
        bottom = [b + v for b, v in zip(bottom, parts[p])]
    ax.set(title=title, xlabel="step", ylabel="seconds (stamp to stamp)")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_compare(means: dict[str, dict[str, float]], title: str, out: Path) -> Path:
    """Horizontal stacked bars: one run per bar, its mean step split into PARTS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(means)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 2.0), constrained_layout=True)
    left = [0.0] * len(labels)
    for p, color in zip(PARTS, COLORS):
        vals = [means[k].get(p, 0.0) for k in labels]
        ax.barh(labels, vals, left=left, color=color, label=p)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set(title=title, xlabel="mean seconds per step")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    ax.grid(alpha=0.3, axis="x")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def breakdown_markdown(results: list) -> list[str]:
    """Lines of a table: one row per run (with `step_parts`), mean seconds per measured step of each part."""
    rows = [r for r in results if getattr(r, "ok", False) and getattr(r, "step_parts", None)]
    if not rows:
        return []
    out = [("Where a measured step's wall time goes (mean seconds per step; *unaccounted* = stamp-to-stamp wall time "
           "less every timed part; per-step plots: `RUN_DIR/step_times.png` of each run, all runs: "
           "`bench/results/pipeline_breakdown.png`):"), "",
           "| workload | producers | mode | " + " | ".join(PARTS) + " |",
           "|---|---:|---|" + "---:|" * len(PARTS)]
    for r in rows:
        out.append(f"| {r.workload} | {r.num_producers} | {r.mode} | "
                   + " | ".join(f"{r.step_parts.get(p, 0.0):.3f}" for p in PARTS) + " |")
    return [*out, ""]
