"""Agentic RL with a slow service: how much of its speed rlbus keeps when episodes wait on a tool, a judge or an env.

    .venv/bin/python bench/agentic.py [--workload b1|b2|b3] [--medians M ...] [--seeds 0] [--steps 30]
                                      [--arms nolat async sync trl] [--docs] [KEY=VALUE ...]  # overrides, every arm

Workloads (bench/agentic_workloads.py; the services are in bench/agentic_tools.py), each the quickstart's task and
model with one remote service's lognormal latency (median M seconds, sigma 1, capped at 8 s):

- `b1` (the default), a slow tool: the calculator behind the latency (an async tool, as an HTTP API is);
- `b2`, a judge with few slots: the reward (the math reward's score) after the judge's latency, at most
  RLBUS_JUDGE_SLOTS (4) calls at once per producer; the calculator instant;
- `b3`, a straggling environment: the question as a Gym-style environment (its step is the calculator, or scores the
  answer) whose steps wait the latency (M 0.2 s by default); a share RLBUS_ENV_STRAGGLE (0.02) of steps straggles
  for RLBUS_ENV_STRAGGLE_S (30 s), a share RLBUS_ENV_HANG (0.005) hangs until rollout.episode_timeout_s (60 s) gives
  the task back (an infrastructure failure: rolled out again, never trained). Every rlbus arm runs
  `rollout.redundant_samples=2` (a group starts n + 2 episodes and is the first n to finish; pass
  `rollout.redundant_samples=0` to see the run without).

A shape variable set in the caller's environment wins over its default. Arms, run one after another in one
invocation on the same machine (each rlbus arm its own `rlbus up`, from scratch):

- `nolat`: the same task without the latency (the speed to keep);
- `async`: the latency, rlbus's defaults for such a run (`rollout.max_inflight_tasks=0`: tasks in flight sized
  from the engine's idle time; the staleness bound follows the measured wait up to trainer.max_staleness_for_latency);
- `sync`: the latency, synchronous (`trainer.max_staleness=0 trainer.max_staleness_for_latency=0`): one
  step's groups in flight, all on the current weights;
- `trl` (b1 and b3): TRL 1.16's GRPOTrainer with its own tool-calling path and the same latency, one process under
  the TRL venv's python (`.bench/trl-venv`, made by `.venv/bin/python bench/peer_trl.py --setup`; run by default
  when it exists), bench/agentic_trl.py. It gets the config the rlbus arms run, resolved here (the overrides
  included): the model, the training prompts as the feeder loads them (written to a file), the math reward, group
  size, groups per step, two updates a step, the per-turn and response token limits, turns, lr and its schedule,
  clip, temperature and steps. Its row has steps/min, the p95 step interval and the rewards from its step stamps
  (the same window), staleness 0 (it is on-policy), its env steps that timed out as infrastructure failures (b3),
  and N/A where only rlbus has the figure (trainer idle, publish time, staleness bound). Its whole log is the run
  directory's trl.log (`--keep DIR`).

Every rlbus arm runs `rollout.max_inflight_tasks=0` (the quickstart config pins 1, as its published figures were
measured). Per run, after a warm-up of 3 steps: steps/min (from the stamps of the metrics rows), the trainer's
idle share (its wait for data over the window), the p95 step interval, the mean weight publish time, the staleness
bound in force at the end and the mean staleness, the reward over the last 10 steps, and the failed rollouts of the
event log (`ErrorRaised.failure`: infrastructure or environment; for b3 also the ledger's problems). Results go to
bench/results/agentic.json (b1), agentic_b2.json or agentic_b3.json (--results), and with --docs to the workload's
section of docs/benchmarks.md (`## Agentic: a slow tool`, `## Agentic: a judge with few slots`,
`## Agentic: a straggling environment`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.agentic_workloads import ARMS, RLBUS_ARMS, WORKLOADS, Workload  # noqa: E402
from bench.common import TIMED_OUT, git_commit, machine, run_ledger, run_up, shown, tail_up, write_section  # noqa: E402
from bench.peer_trl import TRL_PY  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
WARMUP = 3
TRL_SIDE = ROOT / "bench" / "agentic_trl.py"
#: The workloads the TRL side runs (b2's judge is not built for it).
TRL_WORKLOADS = ("b1", "b3")
#: Fields of a row only an rlbus run has: None (N/A in the tables) in the TRL arm's.
RLBUS_ONLY = ("trainer_idle", "publish_s", "staleness_bound_end", "mismatch_kl_max", "guard_fired")


def summarise(rows: list[dict], stamps: list[float]) -> dict[str, Any]:
    """Rates over the steps after the warm-up, from the moment the warm-up's last row landed."""
    steps = [(r, t) for r, t in zip(rows, stamps) if "reward/mean" in r]
    if len(steps) <= WARMUP + 1:
        return {"error": f"only {len(steps)} step(s)"}
    measured = steps[WARMUP:]
    window = measured[-1][1] - steps[WARMUP - 1][1]
    intervals = sorted(b[1] - a[1] for a, b in zip(steps[WARMUP - 1:], measured))
    wait = sum(r.get("time/wait_data", 0.0) for r, _ in measured)
    rewards = [r["reward/mean"] for r, _ in steps]
    return {
        "steps": len(steps),
        "steps_per_min": round(60.0 * len(measured) / window, 2),
        "trainer_idle": round(wait / window, 3),
        "p95_step_interval_s": round(intervals[min(len(intervals) - 1, int(0.95 * len(intervals)))], 2),
        "publish_s": round(statistics.fmean(r.get("time/publish_weights", 0.0) for r, _ in measured), 4),
        "staleness_bound_end": steps[-1][0].get("staleness/bound"),
        "staleness_mean": round(statistics.fmean(r.get("staleness/mean", 0.0) for r, _ in measured), 2),
        "mismatch_kl_max": round(max((r.get("mismatch/kl_k3", 0.0) for r, _ in measured), default=0.0), 4),
        "guard_fired": sum(1 for r, _ in steps if r.get("guard/fired")),
        "first5": round(statistics.fmean(rewards[:5]), 3),
        "last10": round(statistics.fmean(rewards[-10:]), 3),
        "rewards": [round(x, 3) for x in rewards],
        "window_s": round(window, 1),
    }


def failed_rollouts(run_dir: Path) -> dict[str, int]:
    """The rollouts the run's producers failed, from its event log (events/errors.jsonl: `ErrorRaised.failure`,
    infrastructure or environment; each such task was given back and rolled out again, or dead-lettered)."""
    out = {"infra_failures": 0, "env_failures": 0, "dead_letters": 0}
    errors, dead = run_dir / "events" / "errors.jsonl", run_dir / "events" / "dead_letters.jsonl"
    for line in errors.read_text().splitlines() if errors.is_file() else []:
        failure = json.loads(line)["msg"].get("failure", "") if line.strip() else ""
        if failure == "infrastructure":
            out["infra_failures"] += 1
        elif failure == "environment":
            out["env_failures"] += 1
    out["dead_letters"] = sum(1 for line in (dead.read_text().splitlines() if dead.is_file() else []) if line.strip())
    return out


def seeded(seed: int, steps: int) -> list[str]:
    """Every arm's length and seeds."""
    return [f"trainer.total_steps={steps}", f"trainer.seed={seed}", f"feeder.seed={seed}", f"data.seed={seed}"]


def run_arm(wl: Workload, arm: str, median: float, seed: int, steps: int, work: Path, timeout: float,
            overrides: list[str] = ()) -> dict[str, Any]:
    run_dir = work / f"{arm}-m{median:g}-s{seed}"
    argv = [sys.executable, "-m", "rlbus.cli", "up", str(CONFIG), f"name=agentic-{wl.name}-{arm}-s{seed}",
            f"logging.run_dir={run_dir}", *seeded(seed, steps), "logging.plot=false", "eval.interval=0",
            *wl.overrides(arm, seed, overrides)]
    env = dict(os.environ, **wl.latency_env(arm, median, seed))
    rows, stamps, rc, started, ended = tail_up(argv, run_dir, timeout, env=env)
    out: dict[str, Any] = {"arm": arm, "median_s": median if arm != "nolat" else 0.0, "seed": seed, "rc": rc,
                           "wall_s": round(ended - started, 1)}
    out.update(summarise(rows, stamps))
    out.update(failed_rollouts(run_dir))
    if wl.failures:  # every released task trained once, or accounted for (`rlbus events RUN --ledger`)
        ledger = run_ledger(run_dir)
        out.update(ledger_trained=ledger["trained"], ledger_problems=ledger["problems"])
    if rc not in (0, TIMED_OUT) or "error" in out:
        log = (run_dir / "launcher.out").read_text(errors="replace").strip().splitlines()
        out["log_tail"] = log[-30:]
    return out


def trl_settings(wl: Workload, cfg: Any, seed: int, steps: int, model: Path, prompts: Path) -> dict[str, Any]:
    """What the TRL side runs (bench/agentic_trl.py): the rlbus arms' resolved config, in its terms."""
    r, t, a = cfg.rollout, cfg.trainer, cfg.algorithm
    return {"workload": wl.name, "model": str(model), "prompts": str(prompts), "seed": seed, "steps": steps,
            "groups_per_step": t.groups_per_step, "n": r.n, "mini_batches": t.mini_batches,
            "max_new_tokens": r.max_new_tokens, "max_response_tokens": r.max_response_tokens,
            "max_turns": r.max_turns, "max_tool_response_tokens": r.max_tool_response_tokens,
            "episode_timeout_s": r.episode_timeout_s, "temperature": r.temperature, "top_p": r.top_p,
            "top_k": r.top_k, "format_reward": r.format_reward, "lr": t.lr, "betas": list(t.betas),
            "weight_decay": t.weight_decay, "warmup_steps": t.warmup_steps, "lr_schedule": t.lr_schedule,
            "min_lr_ratio": t.min_lr_ratio, "grad_clip": t.grad_clip, "kl_coef": a.kl_coef,
            "clip_ratio_low": a.clip_ratio_low, "clip_ratio_high": a.clip_ratio_high,
            "norm_adv_by_std": a.norm_adv_by_std}


def trl_argv(settings: Path, out: Path) -> list[str]:
    """The TRL side's command: bench/agentic_trl.py under the TRL venv's python."""
    return [str(TRL_PY), str(TRL_SIDE), str(settings), str(out)]


def write_trl_prompts(wl: Workload, cfg: Any, path: Path) -> Path:
    """The run's training prompts as rlbus's feeder loads them, one JSON row each ({prompt, truth}); b3's truth is
    the answer the straggling environment's reset(seed) sets."""
    from bench.agentic_tools import StragglerEnv
    from rlbus.common.envs import load_tasks

    env = StragglerEnv()
    with path.open("w") as f:
        for ex in load_tasks(cfg):
            truth = ex.ground_truth
            if wl.name == "b3":
                env.reset(seed=int(ex.extra_info["gym_seed"]))
                truth = env.answer
            f.write(json.dumps({"prompt": [{"role": m.role, "content": m.content} for m in ex.prompt],
                                "truth": truth}) + "\n")
    return path


def trl_summary(out: Path) -> dict[str, Any]:
    """A TRL run's row from its OUT.json: summarise's rates and rewards over its step stamps, N/A for what only
    rlbus has, staleness 0 (on-policy), the env steps that timed out as infrastructure failures."""
    if not out.is_file():
        return {"error": "no output"}
    d = json.loads(out.read_text())
    steps = d["steps"]
    row = summarise([{"reward/mean": x["reward"]} for x in steps], [x["t"] for x in steps])
    row.update({k: None for k in RLBUS_ONLY}, staleness_mean=0.0, infra_failures=d.get("timeouts", 0),
               env_failures=0, startup_s=round(steps[0]["t"] - d["t_start"], 1) if steps else None,
               tool_calls_per_sample=round(statistics.fmean(x["tool_calls"] for x in steps), 3) if steps else None,
               versions=d.get("versions"))
    return row


def run_trl(wl: Workload, median: float, seed: int, steps: int, work: Path, timeout: float,
            overrides: list[str] = ()) -> dict[str, Any]:
    """One TRL run (bench/agentic_trl.py) of the config the rlbus arms run, with the same latency variables."""
    import msgspec

    from rlbus.common.model.ensure import ensure_model
    from rlbus.schemas.config_io import load_config

    cfg = load_config(CONFIG, [*seeded(seed, steps), *wl.overrides("trl", seed, overrides)])
    model = Path(cfg.model.path) if Path(cfg.model.path).is_absolute() else ROOT / cfg.model.path
    model = Path(ensure_model(msgspec.structs.replace(cfg.model, path=str(model))))
    run_dir = work / f"trl-m{median:g}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = write_trl_prompts(wl, cfg, run_dir / "prompts.jsonl")
    settings = run_dir / "settings.json"
    settings.write_text(json.dumps(trl_settings(wl, cfg, seed, steps, model, prompts), indent=1) + "\n")
    started = time.time()
    rc, output = run_up(trl_argv(settings, run_dir / "out.json"), timeout,
                        env=dict(os.environ, **wl.latency_env("trl", median, seed)))
    ended = time.time()
    (run_dir / "trl.log").write_text(output)
    out: dict[str, Any] = {"arm": "trl", "median_s": median, "seed": seed, "rc": rc,
                           "wall_s": round(ended - started, 1)}
    out.update(trl_summary(run_dir / "out.json"))
    if rc not in (0, TIMED_OUT) or "error" in out:
        out["log_tail"] = output.strip().splitlines()[-30:]
    return out


def _na(value: Any, spec: str = "") -> str:
    """`value` formatted, N/A where the arm has no such figure (None)."""
    return "N/A" if value is None else format(value, spec)


def _header(d: dict[str, Any], wl: Workload) -> str:
    return (f"Command: `{d['command'].strip()}` (commit `{d['commit']}`, {d['date']}). Machine: "
            f"{d['machine']['cpu_model']}, {d['machine']['cores']} cores, load {d['machine']['load_avg_1m']} at the "
            f"start. {wl.described(d.get('shape', {}))}; {d['steps']} steps, rates after {WARMUP} warm-up steps.")


def _failed(rs: list[dict[str, Any]]) -> str:
    """Failed rollouts of `rs`, all together: infrastructure / environment."""
    return f"{sum(r.get('infra_failures', 0) for r in rs)} / {sum(r.get('env_failures', 0) for r in rs)}"


def by_arm(d: dict[str, Any]) -> str:
    """The docs page's section: each arm and latency median over its seeds (every seed's row stays in `report`,
    printed on the console, and the results file)."""
    wl = WORKLOADS[d.get("workload", "b1")]
    ok = [r for r in d["runs"] if "steps_per_min" in r]
    base = {r["seed"]: r["steps_per_min"] for r in ok if r["arm"] == "nolat"}
    keys = list(dict.fromkeys((r["arm"], r["median_s"]) for r in d["runs"]))
    extra = " failed rollouts (infra / env) |" if wl.failures else ""
    lines = [_header(d, wl), "",
             (f"| arm | {wl.waits} median | seeds | steps/min, mean (range) | of no-latency | mean staleness | "
              f"reward last 10 |{extra}"),
             "|---|---:|---:|---|---:|---:|---:|" + ("---:|" if wl.failures else "")]
    for arm, median in keys:
        rs = [r for r in ok if (r["arm"], r["median_s"]) == (arm, median)]
        failed = sum(1 for r in d["runs"] if (r["arm"], r["median_s"]) == (arm, median) and r not in rs)
        if not rs:
            lines.append(f"| {arm} | {median:g} s | {failed} failed | | | | |" + (" |" if wl.failures else ""))
            continue
        rate = [r["steps_per_min"] for r in rs]
        share = [r["steps_per_min"] / base[r["seed"]] for r in rs if r["seed"] in base]
        lines.append(f"| {arm} | {median:g} s | {len(rs)}" + (f" ({failed} failed)" if failed else "")
                     + f" | {statistics.fmean(rate):.1f} ({min(rate):.1f}-{max(rate):.1f}) | "
                     + (f"{statistics.fmean(share):.0%}" if share else "-")
                     + f" | {statistics.fmean(r['staleness_mean'] for r in rs):.2f} | "
                     f"{statistics.fmean(r['last10'] for r in rs):.3f} |"
                     + (f" {_failed(rs)} |" if wl.failures else ""))
    lines += versus_trl(ok)
    lines += ["", f"Every seed's row (trainer idle, p95 step interval, staleness bound): {shown(Path(d['results']))}."]
    return "\n".join(lines)


def versus_trl(ok: list[dict[str, Any]]) -> list[str]:
    """rlbus's steps/min over TRL's, per arm and median (means over the seeds TRL ran: runs of one seed share the
    machine's load, runs of other seeds need not)."""
    def rate(arm: str, median: float) -> float | None:
        seeds = {r["seed"] for r in ok if (r["arm"], r["median_s"]) == ("trl", median)}
        rs = [r["steps_per_min"] for r in ok if (r["arm"], r["median_s"]) == (arm, median) and r["seed"] in seeds]
        return statistics.fmean(rs) if rs else None

    out = []
    for median in dict.fromkeys(r["median_s"] for r in ok if r["arm"] == "trl"):
        trl = rate("trl", median)
        ratios = [f"{arm} {mine / trl:.1f}x" for arm in ("async", "sync") if (mine := rate(arm, median)) and trl]
        if ratios:
            seeds = sorted({r["seed"] for r in ok if (r["arm"], r["median_s"]) == ("trl", median)})
            out.append(f"rlbus's steps/min over TRL's at a median of {median:g} s, on the seeds TRL ran "
                       f"({', '.join(map(str, seeds))}): " + ", ".join(ratios) + ".")
    return ["", *out] if out else []


def report(d: dict[str, Any]) -> str:
    wl = WORKLOADS[d.get("workload", "b1")]
    extra = " failed rollouts (infra / env) | ledger problems |" if wl.failures else ""
    lines = [_header(d, wl), "",
             f"| arm | {wl.waits} median | seed | steps/min | of no-latency | trainer idle | p95 step interval | "
             f"staleness bound (end) | mean staleness | reward first 5 | reward last 10 |{extra}",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if wl.failures else "")]
    base = {r["seed"]: r["steps_per_min"] for r in d["runs"] if r["arm"] == "nolat" and "steps_per_min" in r}
    for r in d["runs"]:
        ledger = len(r["ledger_problems"]) if "ledger_problems" in r else None  # the TRL arm has no ledger
        tail = f" {_failed([r])} | {_na(ledger)} |" if wl.failures else ""
        if "steps_per_min" not in r:
            lines.append(f"| {r['arm']} | {r['median_s']:g} s | {r['seed']} | failed: {r.get('error', r['rc'])} "
                         "| | | | | | | |" + tail)
            continue
        share = f"{r['steps_per_min'] / base[r['seed']]:.0%}" if r["seed"] in base else "-"
        lines.append(f"| {r['arm']} | {r['median_s']:g} s | {r['seed']} | {r['steps_per_min']:.1f} | {share} | "
                     f"{_na(r['trainer_idle'], '.0%')} | {r['p95_step_interval_s']:.2f} s | "
                     f"{_na(r['staleness_bound_end'])} | "
                     f"{r['staleness_mean']:.2f} | {r['first5']:.3f} | {r['last10']:.3f} |" + tail)
    lines += ["", f"Results: {shown(Path(d['results']))}."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; --medians and --results default to the workload's."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="b1",
                    help="b1: a slow tool; b2: a judge with few slots; b3: a straggling environment")
    ap.add_argument("--medians", type=float, nargs="+", default=None,
                    help="latency medians in seconds (b1, b2: 1.0; b3: 0.2)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--arms", nargs="+", default=None, choices=list(ARMS),
                    help="default: nolat async sync, and trl where the TRL venv exists and the workload is b1 or b3")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--results", type=Path, default=None,
                    help="results file (b1: bench/results/agentic.json; b2, b3: agentic_b2.json, agentic_b3.json)")
    ap.add_argument("--docs", action="store_true", help="write the workload's section of docs/benchmarks.md")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep each run's directory under this one (rlbus ui / rlbus status on it), not in a temp dir")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="config overrides for every arm (an arm's own settings win)")
    args = ap.parse_args(argv)
    wl = WORKLOADS[args.workload]
    if args.arms is None and wl.name in TRL_WORKLOADS and not TRL_PY.is_file():
        print(f"arm trl left out: {TRL_PY} missing (`.venv/bin/python bench/peer_trl.py --setup` makes it)",
              file=sys.stderr)
    trl_ok = TRL_PY.is_file() and wl.name in TRL_WORKLOADS
    args.arms = args.arms or [*RLBUS_ARMS, *(["trl"] if trl_ok else [])]
    if "trl" in args.arms and wl.name not in TRL_WORKLOADS:
        ap.error(f"--arms trl: the TRL side runs {' and '.join(TRL_WORKLOADS)}, not {wl.name}")
    if "trl" in args.arms and not TRL_PY.is_file():
        ap.error(f"--arms trl: {TRL_PY} missing; make it with `.venv/bin/python bench/peer_trl.py --setup`")
    args.medians = args.medians or [wl.default_median]
    args.results = args.results or wl.results
    return args


def main() -> int:
    args = parse_args()
    wl = WORKLOADS[args.workload]
    d: dict[str, Any] = {"command": "python bench/agentic.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
                         "date": time.strftime("%Y-%m-%d"), "machine": machine(), "workload": wl.name,
                         "shape": wl.shape_in(), "steps": args.steps, "results": str(args.results), "runs": []}
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="rlbus-agentic-"))
        for seed in args.seeds:
            for median in args.medians:
                for arm in args.arms:
                    if arm == "nolat" and median != args.medians[0]:
                        continue  # one no-latency run per seed
                    if arm == "trl":
                        r = run_trl(wl, median, seed, args.steps, Path(tmp), args.timeout, args.overrides)
                    else:
                        r = run_arm(wl, arm, median, seed, args.steps, Path(tmp), args.timeout, args.overrides)
                    print(json.dumps({k: v for k, v in r.items() if k not in ("rewards", "log_tail")}), flush=True)
                    d["runs"].append(r)
                    args.results.parent.mkdir(parents=True, exist_ok=True)
                    args.results.write_text(json.dumps(d, indent=1) + "\n")
    print(report(d))
    if args.docs:
        write_section(wl.heading, by_arm(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
