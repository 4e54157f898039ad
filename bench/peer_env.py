"""rlbus against TRL's GRPOTrainer on an environment's task: held-out accuracy by step and the time to reach a
held-out target from process start, same model, prompts, reward, group size and budget, seeds alternating.

    .venv/bin/python bench/peer_trl.py --task smollm2 --setup     # once: .bench/trl-venv and the model
    .venv/bin/python bench/peer_env.py [configs/gcd_smollm2.yaml] [--seeds 0 1 2] [--save-every 10] [--docs]

Both sides train on the config's training split (bench/env_score.py dumps it as chat messages: the prompts the
feeder releases) with its reward (the TRL side asks bench/env_score.py, rlbus's own scorer run apart, for every
completion's), at the config's sampling temperature, samples per prompt, prompts per step, new tokens, learning rate
and clip range, for `trainer.total_steps` steps; TRL with one update per batch and token-mean loss ("dapo"), as
bench/peer_trl_side.py sets it.

- rlbus: `rlbus up CONFIG` with its evaluator off (`eval.interval=0`: the TRL side has none either), a checkpoint
  every --save-every steps, each exported afterwards (`rlbus export`). A version's time is when the trainer
  published it (events/weights.jsonl), from the moment the bench started the process.
- TRL: bench/peer_trl_side.py saves its model after every --save-every steps and stamps the moment, before saving.

Every saved model, and the starting one, is scored afterwards by the same code, one at a time on a quiet machine:
the config's held-out split sampled as the evaluator does (`eval.n` answers a question at `eval.temperature`;
producers/evaluator.py's `eval_run_config` and `eval_metrics`). The target is 0.9 x the lower of the two sides' mean
final accuracy, so both can reach it; a side's time to it is that of the first saved step whose accuracy reaches it.
Writes bench/results/peer_env_<config>.json and, with --docs, its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import (
    TARGET_SHARE,
    appended,
    bounded_ratio,
    git_commit,
    machine,
    machine_line,
    more_seeds,
    peer_summary,
    run_ledger,
    run_up,
    time_to,
    write_section,
)
from bench.peer_tasks import ROOT
from bench.peer_trl import TRL_PY, TRL_SIDE
from rlbus.common.data.datasets import example_to_task
from rlbus.common.envs import load_heldout_tasks
from rlbus.consumers.event_log import read_entries
from rlbus.producers.build import build_rollout
from rlbus.producers.evaluator import eval_metrics, eval_run_config
from rlbus.schemas.config import RunConfig
from rlbus.schemas.config_io import load_config
from rlbus.trainer.checkpoint import checkpoint_name

CONFIG = ROOT / "configs" / "gcd_smollm2.yaml"

#: rlbus sides beyond the config's own engine ("rlbus"): their label and the settings they add. On vLLM one producer
#: runs 4 tasks (32 sequences) at once in one engine: on 2 cores a second engine (three processes) costs more.
ENGINES = {"rlbus-vllm": ["rollout.engine={type: vllm, max_model_len: 512}", "rollout.num_producers=1",
                          "rollout.max_inflight_tasks=4"]}
SIDES = ("rlbus", "trl", *ENGINES)


def evaluate(cfg: RunConfig, model_dir: Path) -> dict[str, float]:
    """eval/* of the model in `model_dir` on the config's held-out split, sampled as the evaluator samples."""
    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model_dir), gguf=""))

    async def run() -> dict[str, float]:
        stack = build_rollout(eval_run_config(cfg), seed=cfg.trainer.seed)
        try:
            held = load_heldout_tasks(cfg, cfg.eval.num_prompts, stack.tokenizer)
            tasks = [example_to_task(ex, task_id=f"eval-{ex.index}", n=cfg.eval.n) for ex in held]
            t0 = time.perf_counter()
            out = eval_metrics(await stack.agent_loop.rollout_many(tasks, cfg.eval.n))
            out["eval/seconds"] = time.perf_counter() - t0
            out["eval/num_prompts"] = len(tasks)
            return out
        finally:
            await stack.engine.close()

    return asyncio.run(run())


def scored(cfg: RunConfig, model_dir: Path) -> dict[str, float]:
    """evaluate()'s eval/*, rounded as the results files keep them."""
    return {k: round(v, 4) for k, v in evaluate(cfg, model_dir).items()}


def score_saved(cfg: RunConfig, run: dict) -> None:
    """Score each of `run`'s saved models now, alone on the machine, into its entry, then remove the model."""
    for saved in run["saved"]:
        saved.update({k.removeprefix("eval/"): v for k, v in scored(cfg, Path(saved["path"])).items()})
        shutil.rmtree(saved.pop("path"), ignore_errors=True)


def run_rlbus(config: Path, overrides: list[str], seed: int, steps: int, every: int, work: Path,
              timeout: float, side: str = "rlbus") -> dict:
    run_dir = work / f"{side}-s{seed}"
    argv = [sys.executable, "-m", "rlbus.cli", "up", str(config), f"name=peer-env-s{seed}", f"logging.run_dir={run_dir}",
            f"trainer.seed={seed}", f"feeder.seed={seed}", f"trainer.total_steps={steps}", "eval.interval=0",
            f"trainer.checkpoint_interval={every}", f"trainer.keep_checkpoints={steps // every + 1}",
            "logging.plot=false", *overrides, *ENGINES.get(side, [])]
    t0 = time.time()
    rc, output = run_up(argv, timeout)
    wall = time.time() - t0
    out: dict = {"side": side, "seed": seed, "rc": rc, "wall_s": round(wall, 1), "saved": []}
    if rc != 0:
        out["error"] = output.strip().splitlines()[-20:]
        return out
    published = {e.msg.version: e.msg.created_at for e in read_entries(run_dir, "weights")}
    for step in range(every, steps + 1, every):
        model = work / f"{side}-s{seed}-step_{step}"
        subprocess.run([sys.executable, "-m", "rlbus.cli", "export", str(run_dir / "checkpoints" / checkpoint_name(step)),
                        str(model)], cwd=ROOT, check=True, capture_output=True)
        out["saved"].append({"step": step, "t": round(published[step] - t0, 1), "path": str(model)})
    out["ledger"] = run_ledger(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def run_trl(config: Path, overrides: list[str], cfg: RunConfig, seed: int, steps: int, every: int, work: Path,
            prompts: Path, timeout: float) -> dict:
    result = work / f"trl-s{seed}.json"
    score = [sys.executable, str(ROOT / "bench" / "env_score.py"), str(config), *overrides]
    r, a = cfg.rollout, cfg.algorithm
    argv = [str(TRL_PY), str(TRL_SIDE), "--model", cfg.model.path, "--out", str(result), "--seed", str(seed),
            "--steps", str(steps), "--prompts", str(cfg.trainer.groups_per_step), "--n", str(r.n),
            "--max-new-tokens", str(r.max_new_tokens), "--lr", str(cfg.trainer.lr), "--temperature",
            str(r.temperature), "--epsilon-high", str(a.clip_ratio_high), "--prompts-file", str(prompts),
            "--score-cmd", json.dumps(score), "--save-at", *map(str, range(every, steps + 1, every))]
    t0 = time.time()
    rc, output = run_up(argv, timeout)
    wall = time.time() - t0
    (work / f"trl-s{seed}.log").write_text(output)
    out: dict = {"side": "trl", "seed": seed, "rc": rc, "wall_s": round(wall, 1), "saved": []}
    if rc != 0 or not result.is_file():
        out["error"] = output.strip().splitlines()[-20:]
        return out
    d = json.loads(result.read_text())
    out["saved"] = [{"step": s["step"], "t": round(s["t"] - t0, 1), "path": s["path"]} for s in d["saved"]]
    out["rewards"] = [round(s["reward"], 4) for s in d["steps"]]
    return out


def report(d: dict) -> str:
    s = peer_summary(d)
    steps = sorted({x["step"] for r in d["runs"] for x in r["saved"]})
    lines = [
        f"## Against TRL's GRPOTrainer on a reasoning-gym task: {Path(d['config']).stem}", "",
        (f"Both sides train `{d['config']}` ({d['steps']} steps, seeds alternating which side goes first) and every "
         "saved model is scored afterwards by the same code on the held-out split (the evaluator's sampling); "
         f"version 0 scores {d['v0']['eval/accuracy']:.3f}. Time is from the process's start; the target is "
         f"{TARGET_SHARE} x the lower side's mean final accuracy: {s['target']:.3f}. Command: `{d['command']}`. "
         f"{machine_line(d['machine'])} rlbus at `{d['commit']}`, {d['date']}."
        + "".join(f" {x}" for x in more_seeds(d))
        + (f" {d['stopped']}" if d.get("stopped") else "") + " " + _engines(d)),
        "",
        "| side | seed | " + " | ".join(f"step {k}: accuracy (s)" for k in steps)
        + f" | steps/min, steps {steps[0]}-{steps[-1]} | time to target s | wall s | load at start |",
        "|---|---:|" + "---:|" * len(steps) + "---:|---:|---:|---:|",
    ]
    for r in d["runs"]:
        if r["rc"] != 0:
            lines.append(f"| {r['side']} | {r['seed']} | failed (exit {r['rc']}) |" + " |" * (len(steps) + 3))
            continue
        at = {x["step"]: x for x in r["saved"]}
        cells = [f"{at[k]['accuracy']:.3f} ({at[k]['t']:.0f})" if k in at else "" for k in steps]
        t = time_to(r, s["target"])
        first, last = r["saved"][0], r["saved"][-1]
        rate = 60 * (last["step"] - first["step"]) / max(last["t"] - first["t"], 1e-9)
        lines.append(f"| {r['side']} | {r['seed']} | " + " | ".join(cells) + f" | {rate:.2f}"
                     f" | {'not reached' if t is None else f'{t:.0f}'} | {r['wall_s']:.0f}"
                     f" | {r.get('load1_at_start', '')} |")
    lines += [f"- {r['side']} seed {r['seed']}: {r['note']}" for r in d["runs"] if r.get("note")]
    reached = s["reached"]
    if reached["rlbus"] and reached["trl"]:
        ratio = statistics.fmean(reached["rlbus"]) / statistics.fmean(reached["trl"])
        lines += ["", (f"Mean final accuracy: rlbus {s['final']['rlbus']:.3f}, TRL {s['final']['trl']:.3f}. Mean time "
                       f"to the target: rlbus {statistics.fmean(reached['rlbus']):.0f} s "
                       f"({len(reached['rlbus'])} of {len(s['times']['rlbus'])} runs reached it), TRL "
                       f"{statistics.fmean(reached['trl']):.0f} s ({len(reached['trl'])} of {len(s['times']['trl'])}): "
                       f"rlbus takes {ratio:.2f}x TRL's time.{_bound(s)} Results: `{d['results']}`.")]
    for side in sorted({r["side"] for r in d["runs"]} & set(ENGINES)):
        o = peer_summary(d, mine=side, target=s["target"])
        ran, got = o["times"]["rlbus"], o["reached"]["rlbus"]
        if not ran:
            continue
        when = (f"mean time to it {statistics.fmean(got):.0f} s ({len(got)} of {len(ran)} runs reached it)"
                + (f", {statistics.fmean(got) / statistics.fmean(reached['trl']):.2f}x TRL's" if reached["trl"] else "")
                if got else f"none of its {len(ran)} runs reached it")
        lines[-1] += (f" {side} (`{' '.join(ENGINES[side])}`), against the same target: mean final accuracy "
                      f"{o['final']['rlbus']:.3f}; {when}.")
    return "\n".join(lines) + "\n"


def _engines(d: dict) -> str:
    """What each side runs, and what a step's time holds."""
    engines = ("rlbus runs `rlbus up` with the config's engine (HF), rlbus-vllm with vLLM's (the CPU build here)."
               if any(r["side"] in ENGINES for r in d["runs"]) else
               "rlbus runs `rlbus up` with the config's engine (HF). vLLM's engine did not run on this task: on these "
               "2 cores its engine core and the trainer contend ('Against TRL's GRPOTrainer on a real model' above).")
    return (f"{engines} TRL's GRPOTrainer generates with transformers in its own process, then updates. A step's "
            "time is both sides' generation plus update: rlbus overlaps the producers' generation of the next groups "
            "with the trainer's update (`trainer.max_staleness`), TRL does one after the other.")


def _bound(s: dict) -> str:
    """The ratio when a run that never reached the target counts at its whole run time (it needed longer)."""
    if (b := bounded_ratio(s)) is None:
        return ""
    how, mine, trl, ratio = b
    return (f" Counting each run that never reached it at its whole run time (it would have needed longer): rlbus "
            f"{mine:.0f} s, TRL {trl:.0f} s, {how + ' ' if how else ''}{ratio:.2f}x.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=str(CONFIG.relative_to(ROOT)))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: the config's total_steps)")
    ap.add_argument("--save-every", type=int, default=10, help="steps between saved models (each is scored)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    ap.add_argument("--docs", action="store_true", help="write the section into docs/benchmarks.md")
    ap.add_argument("--from-json", default="", help="only report these results")
    ap.add_argument("--append", action="store_true",
                    help="add these seeds' runs to the results file of the same config, overrides and steps")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=["rlbus", "trl"],
                    help="what runs each seed, in turn (rlbus-vllm: rlbus on the vLLM engine, added with --append)")
    ap.add_argument("overrides", nargs="*", help="config overrides k=v for both sides")
    args = ap.parse_intermixed_args()
    config = Path(args.config)
    results = ROOT / "bench" / "results" / f"peer_env_{config.stem}.json"
    if args.from_json:
        d = json.loads(Path(args.from_json).read_text())
    else:
        if "trl" in args.sides and not TRL_PY.is_file():
            raise SystemExit("no TRL venv: run `.venv/bin/python bench/peer_trl.py --task smollm2 --setup` first")
        cfg = load_config(config, args.overrides)
        steps = args.steps or cfg.trainer.total_steps
        command = shlex.join(["python", "bench/peer_env.py", *sys.argv[1:]])
        d = {"command": command, "config": str(config),
             "overrides": args.overrides, "steps": steps, "machine": machine(), "commit": git_commit(),
             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "date": time.strftime("%Y-%m-%d"),
             "results": str(results.relative_to(ROOT)), "runs": []}
        if args.append and results.is_file():
            d = appended(json.loads(results.read_text()), d, same=("config", "overrides", "steps"), drop=("stopped",))
        with tempfile.TemporaryDirectory(prefix="rlbus-peer-env-") as tmp:
            work = Path(tmp)
            prompts = work / "train.jsonl"
            subprocess.run([sys.executable, str(ROOT / "bench" / "env_score.py"), str(config), *args.overrides,
                            "--dump-train", str(prompts)], cwd=ROOT, check=True)
            for k, seed in enumerate(args.seeds):
                sides = args.sides if k % 2 == 0 else args.sides[::-1]
                for side in sides:
                    commit, load = git_commit(), round(os.getloadavg()[0], 2)
                    run = (run_trl(config, args.overrides, cfg, seed, steps, args.save_every, work, prompts,
                                   args.timeout)
                           if side == "trl" else
                           run_rlbus(config, args.overrides, seed, steps, args.save_every, work, args.timeout, side))
                    score_saved(cfg, run)
                    d["runs"].append({**run, "commit": commit, "load1_at_start": load})
                    print(f"{side} seed {seed}: exit {run['rc']}, {run['wall_s']:.0f} s, "
                          + ", ".join(f"step {x['step']} {x['accuracy']:.3f} at {x['t']:.0f} s" for x in run["saved"]),
                          flush=True)
                    if "v0" not in d:
                        d["v0"] = scored(cfg, Path(cfg.model.path))
                    results.write_text(json.dumps(d, indent=1) + "\n")
    text = report(d)
    print(text)
    if args.docs:
        write_section(text.splitlines()[0], text)
    return 0 if all(r["rc"] == 0 for r in d["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
