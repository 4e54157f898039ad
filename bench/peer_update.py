"""Same batch, same update? rlbus's trainer against TRL's GRPO loss on the batches of a real rlbus run.

    .venv/bin/python bench/peer_update.py [--task adder1] [--seed 0] [--steps 20]

Needs `bench/peer_trl.py --task adder1 --setup` first (the TRL venv and the task's model). Runs the task's rlbus
side of `bench/peer_trl.py` for STEPS steps with `logging.record=full` (asynchronous, max_staleness 1, so some of
its batches hold tokens sampled by the policy one version behind), then, from the run's event log:

1. replays the recorded steps into a fresh one-rank TrainEngine (rlbus's code path: `rlbus replay`), keeping its
   weights before each step and its gradient after the grad-norm clip (an optimizer step pre-hook);
2. computes, at those same weights before each step, the gradient of the same batch under
   `algorithm.off_policy=none` (no importance weight: what an on-policy trainer does with a batch);
3. has TRL compute its gradient at those weights on the same batch (`bench/peer_update_trl.py`, in the TRL venv:
   GRPOTrainer.compute_loss, its advantages, its clip) with its std epsilon (1e-4) and with rlbus's (1e-6), and
   run its own AdamW on the batches from the same start.

Per step it reports the share of stale response tokens and the relative distance |g_a - g_b| / |g_b| between
gradients: rlbus without the weight against TRL with the same epsilon (the numerics: rounding only, if the two
implement the same loss), TRL's epsilon against rlbus's, rlbus's importance weight against none, and each run's
weights after the step against the other's. Writes bench/results/peer_update_<task>.json and the section "Same
batch, same update" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from bench.common import git_commit, machine, machine_line, write_section
from bench.peer_task import write_jsonl
from bench.peer_trl import TASKS, TRL_PY, run_rlbus
from rlbus.consumers.event_log import load_step_batch, read_steps
from rlbus.trainer.replay import build_engine, replay_config, replay_threads

ROOT = Path(__file__).resolve().parents[1]
TRL_UPDATE = ROOT / "bench" / "peer_update_trl.py"
HEADING = "## Same batch, same update: rlbus's trainer against TRL's GRPO loss"
BATCH_FIELDS = ("input_ids", "attention_mask", "response_mask", "rollout_log_probs", "token_level_rewards",
                "group_index", "versions")


def flat(tensors: dict[str, torch.Tensor], names: list[str] | None = None) -> torch.Tensor:
    """The tensors named `names` (default: all, sorted) as one float64 vector."""
    return torch.cat([tensors[k].flatten().double() for k in (names or sorted(tensors))])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|."""
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


class GradTap:
    """The gradients of an engine's parameters as its optimizer is about to step (after the grad-norm clip)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.grads: dict[str, torch.Tensor] = {}
        engine.optimizer.register_step_pre_hook(self._take)

    def _take(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.grads = {}
        for name, p in self.engine.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                self.grads[name] = g.detach().clone()


def weights(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in engine.full_state_dict().items()}


def run_and_export(task: Any, seed: int, steps: int, work: Path, ex: Path, timeout: float) -> tuple[Path, list]:
    data = write_jsonl(work / "peer.jsonl", 4096, 0, task.system, task.operands)
    run = run_rlbus(task, data, seed, steps, work, timeout, ("logging.record=full",))
    if not run.ok:
        raise SystemExit(f"the rlbus run failed: {run.error}")
    run_dir = next(p for p in work.iterdir() if p.is_dir() and p.name.startswith("peer-s"))
    records = read_steps(run_dir)[:steps]
    for rec in records:
        batch = load_step_batch(run_dir, rec)
        save_file({k: batch[k].contiguous() for k in BATCH_FIELDS}, str(ex / f"batch_{rec.step}.safetensors"))
    return run_dir, records


def rlbus_side(run_dir: Path, records: list, ex: Path) -> list[dict[str, Any]]:
    """Replays the recorded steps (decoupled, as the run trained) and takes the same batches' gradients with no
    importance weight at the same weights; keeps both gradients and the weights before and after each step."""
    cfg = replay_config(run_dir)
    replay_threads(cfg, records[0])  # the trainer's thread count: bit for bit (rlbus replay's)
    engine = build_engine(cfg, None)
    tap = GradTap(engine)
    plain_cfg = replay_config(run_dir, ["algorithm.off_policy=none"])
    plain = build_engine(plain_cfg, None)
    plain_tap = GradTap(plain)
    rows = []
    before = weights(engine)
    for rec in records:
        batch = load_step_batch(run_dir, rec)
        save_file(before, str(ex / f"rlbus_before_{rec.step}.safetensors"))
        set_model_state_dict(plain.model, before, options=StateDictOptions(full_state_dict=True))
        plain_metrics = plain.train_step(batch)
        metrics = engine.train_step(batch)
        mask = batch["response_mask"] > 0
        stale = (batch["versions"][mask] < rec.trained_version).float().mean()
        recorded = rec.metrics
        rows.append({
            "step": rec.step, "trained_version": rec.trained_version, "stale_tokens": float(stale),
            "tokens": int(mask.sum()), "reward": float(batch["token_level_rewards"].sum(-1).mean()),
            "grad_norm": metrics["actor/grad_norm"], "plain_grad_norm": plain_metrics["actor/grad_norm"],
            "replay_equal": all(recorded.get(k) == metrics[k] for k in ("actor/pg_loss", "actor/grad_norm")),
        })
        save_file(tap.grads, str(ex / f"rlbus_grad_{rec.step}.safetensors"))
        save_file(plain_tap.grads, str(ex / f"plain_grad_{rec.step}.safetensors"))
        before = weights(engine)  # after this step, before the next
        save_file(before, str(ex / f"rlbus_after_{rec.step}.safetensors"))
    return rows


def compare(rows: list[dict[str, Any]], ex: Path) -> None:
    """Adds each step's gradient and weight distances to its row."""
    trl = json.loads((ex / "trl_steps.json").read_text())["steps"]
    start = load_file(str(ex / "rlbus_before_1.safetensors"))
    for row, t in zip(rows, trl):
        k = row["step"]
        g_rl = flat(load_file(str(ex / f"rlbus_grad_{k}.safetensors")))
        g_plain = flat(load_file(str(ex / f"plain_grad_{k}.safetensors")))
        g_trl = flat(load_file(str(ex / f"trl_grad_{k}_eps0.0001.safetensors")))
        g_trl6 = flat(load_file(str(ex / f"trl_grad_{k}_eps1e-06.safetensors")))
        after_rl = load_file(str(ex / f"rlbus_after_{k}.safetensors"))
        after_trl = load_file(str(ex / f"trl_after_{k}.safetensors"))
        names = sorted(after_trl)  # TRL's parameters; rlbus's state dict also names the tied output head
        w_rl, w_trl, w0 = flat(after_rl, names), flat(after_trl, names), flat(start, names)
        row.update({
            "numerics": rel(g_plain, g_trl6),  # same loss, same epsilon: rounding only
            "epsilon": rel(g_trl, g_trl6),  # TRL's 1e-4 against rlbus's 1e-6
            "weight": rel(g_rl, g_plain),  # rlbus's importance weight against none
            "rlbus_vs_trl": rel(g_rl, g_trl),  # all of it
            "cos_rlbus_trl": float(torch.nn.functional.cosine_similarity(g_rl, g_trl, dim=0)),
            "trl_grad_norm": t["grad_norm_eps0.0001"], "tokens_trl": t["tokens"],
            "weights_apart": float((w_rl - w_trl).norm() / (w_rl - w0).norm().clamp(min=1e-30)),
        })


def report(res: dict[str, Any], per_step: bool = True) -> str:
    """The comparison, read; `per_step`: with the table of every step (the console's; the docs page leaves it to
    the results file)."""
    rows = res["rows"]
    lines = [
        (f"One rlbus run of the `{res['task']}` task of `bench/peer_trl.py` (seed {res['seed']}, {len(rows)} steps, "
        "asynchronous, max_staleness 1, `logging.record=full`); each recorded step's batch then goes through "
        "rlbus's trainer (replayed from the "
        "event log) and through TRL's `GRPOTrainer.compute_loss` at the same weights (`bench/peer_update_trl.py`). "
        "Gradients are taken after each side's grad-norm clip (1.0); a distance is |a - b| / |b| over all "
        "parameters. *numerics*: rlbus with `off_policy: none` (no importance weight) against TRL with rlbus's std "
        "epsilon (1e-6): the same loss, so rounding only. *epsilon*: TRL's 1e-4 against 1e-6. *weight*: rlbus's "
        "decoupled importance weight (min(exp(proximal - behaviour), 2) per token, the run's setting) against none. "
        "*rlbus vs TRL*: the run's gradient against TRL's as TRL ships. *weights apart*: after step k, the distance "
        "between rlbus's weights and those of TRL's own AdamW run fed the same batches from the same start, over "
        "the distance rlbus's weights moved from the start. Command: `" + res["command"] + "` ("
         + machine_line(res["machine"]) + f"; rlbus {res['rlbus_commit']}, TRL {res['trl_versions']['trl']}, "
         f"transformers {res['trl_versions']['transformers']}; {res['wall_s']:.0f} s)."),
    ]
    if per_step:
        lines += ["", ("| step | stale tokens | grad norm rlbus / TRL | numerics | epsilon | weight | rlbus vs TRL | "
                       "cos | weights apart |"), "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows if per_step else []:
        lines.append(
            f"| {r['step']} | {r['stale_tokens']:.0%} | {r['grad_norm']:.3f} / {r['trl_grad_norm']:.3f} | "
            f"{r['numerics']:.1e} | {r['epsilon']:.1e} | {r['weight']:.1e} | {r['rlbus_vs_trl']:.1e} | "
            f"{r['cos_rlbus_trl']:.6f} | {r['weights_apart']:.1e} |"
        )
    fresh = [r for r in rows if r["stale_tokens"] == 0]
    stale = [r for r in rows if r["stale_tokens"] > 0]
    lines += ["", (f"Largest *numerics* distance {max(r['numerics'] for r in rows):.1e}; *weight* on steps whose "
                   f"tokens were all fresh {max((r['weight'] for r in fresh), default=0):.1e} (the engine's "
                   "sampling log-probs against the trainer's), on steps with stale tokens median "
                   f"{statistics.median(r['weight'] for r in stale) if stale else 0:.1e}. Replayed steps equal to "
                   f"the recorded run's pg-loss and grad norm: {sum(r['replay_equal'] for r in rows)} of "
                   f"{len(rows)}." + ("" if per_step else
                                      f" Every step's row: `bench/results/peer_update_{res['task']}.json`."))]
    if stale:
        cos = [r["cos_rlbus_trl"] for r in stale]
        lines += ["", (
            "What it says: given the same batch at the same weights, rlbus's trainer computes TRL's GRPO update: "
            "with the importance weight off and the same epsilon they differ by float rounding only, so the "
            "response mask, the advantages, the token-mean normalisation and the clip are the same. What separates "
            "the run's update from TRL's is rlbus's off-policy correction of the tokens sampled one version behind "
            f"({len(stale)} of {len(rows)} steps here): it moves the clipped gradient by "
            f"{statistics.median(r['weight'] for r in stale):.1%} (median; cosine to TRL's {min(cos):.4f} to "
            f"{max(cos):.4f}), and TRL's std epsilon by a further {statistics.median(r['epsilon'] for r in rows):.2%}. "
            "So the small per-step gap of the one-digit comparison (0.004-0.007 reward over its first 160 steps, "
            "1-2 standard errors) does not come from how rlbus computes an update, and its synchronous runs, whose "
            "batches hold no stale tokens, learn per step as the asynchronous ones do.")]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("adder", "adder1"), default="adder1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--results", default="", help="'' = bench/results/peer_update_<task>.json")
    ap.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to leave the docs alone")
    ap.add_argument("--from-json", default="", help="only redo the report from a results file")
    args = ap.parse_args()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        print(report(res))
        if args.docs:
            write_section(HEADING, report(res, per_step=False), Path(args.docs))
        return 0
    task = TASKS[args.task]
    if not TRL_PY.is_file() or not (task.model / "config.json").is_file():
        ap.error(f"run `bench/peer_trl.py --task {args.task} --setup` first")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlbus-peer-update-") as tmp:
        work, ex = Path(tmp) / "run", Path(tmp) / "exchange"
        work.mkdir()
        ex.mkdir()
        run_dir, records = run_and_export(task, args.seed, args.steps, work, ex, args.timeout)
        rows = rlbus_side(run_dir, records, ex)
        subprocess.run([str(TRL_PY), str(TRL_UPDATE), "--model", str(task.model), "--exchange", str(ex),
                        "--steps", str(len(rows)), "--n", str(task.n), "--lr", str(task.lr)], check=True)
        compare(rows, ex)
        trl_info = json.loads((ex / "trl_steps.json").read_text())
    res = {"command": shlex.join([".venv/bin/python", "bench/peer_update.py", *sys.argv[1:]]), "task": task.name,
           "seed": args.seed, "machine": machine(), "rlbus_commit": git_commit(), "trl_versions": trl_info["versions"],
           "trl_optimizer": trl_info["optimizer"], "wall_s": time.monotonic() - t0, "rows": rows}
    print(report(res))
    out = Path(args.results) if args.results else ROOT / "bench" / "results" / f"peer_update_{task.name}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    if args.docs:
        write_section(HEADING, report(res, per_step=False), Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
