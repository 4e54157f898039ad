"""What a critic costs: trainer step time and peak memory with `adv_estimator: gae` against GRPO, same batch.

    .venv/bin/python bench/critic.py [--model .rlbus/models/tiny-calculator] [--steps 6] [--docs docs/benchmarks.md]
    .venv/bin/python bench/critic.py --layers 4 --hidden 256 --vocab 4096     # a random, larger Qwen2 instead

Each variant runs in its own fresh process (one FSDP rank, one thread) on the same quickstart-shaped batch: 4
groups of 8 sequences, prompts of 32-40 tokens, responses up to 120, two optimizer updates per step in micro-batches
of 16, as configs/quickstart.yaml. The variants: grpo, gae with a separate critic (`critic.backbone: separate`) and
gae with the value head on the policy (`critic.backbone: shared`). The first step is warm-up; the medians of the
others are reported: step time, its parts (values, critic update, actor update), the step's peak RSS
(`perf/peak_rss_gb`, the high-water mark reset at each step) and the parameters the process holds. Writes
bench/results/critic.json (--results) and, with --docs, the `## Critic cost` section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

import torch
from tensordict import TensorDict

from bench.common import machine, machine_line, tiny_qwen2, write_section
from rlbus.schemas.config import AlgorithmConfig, CriticConfig, TrainerConfig

RESULTS = Path(__file__).parent / "results" / "critic.json"
HEADING = "## Critic cost"
PARTS = ("timing/step_s", "timing/values_s", "timing/critic_update_s", "timing/update_s", "timing/proximal_s",
         "perf/peak_rss_gb")  # fmt: skip


def make_batch(vocab: int, seed: int) -> TensorDict:
    """4 groups x 8 samples: a shared prompt per group, responses of 20-120 tokens, a tool span masked out."""
    g = torch.Generator().manual_seed(seed)
    B, T = 32, 160
    prompt_len = torch.randint(32, 41, (4,), generator=g).repeat_interleave(8)
    lengths = prompt_len + torch.randint(20, 121, (B,), generator=g)
    pos = torch.arange(T)[None]
    attention_mask = (pos < lengths[:, None]).long()
    ids = torch.randint(3, vocab, (B, T), generator=g)
    ids[:, :40] = ids[torch.arange(B) // 8 * 8, :40]  # a group's samples share their prompt
    response_mask = ((pos >= prompt_len[:, None]) & (pos < lengths[:, None])).float()
    response_mask[:, 50:58] = 0.0  # the tool's output
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
    return TensorDict({
        "input_ids": ids * attention_mask, "attention_mask": attention_mask,
        "position_ids": (pos.expand(B, T) * attention_mask).long(), "response_mask": response_mask,
        "rollout_log_probs": -2.0 * response_mask, "token_level_rewards": rewards,
        "group_index": torch.arange(B) // 8, "versions": torch.zeros(B, T, dtype=torch.long),
    }, batch_size=[B])  # fmt: skip


#: variant -> (algorithm.adv_estimator, critic.backbone)
VARIANTS = {"grpo": ("grpo", "separate"), "gae": ("gae", "separate"), "gae_shared": ("gae", "shared")}


def _run(model_dir: str, variant: str, steps: int, vocab: int) -> dict:
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    trainer = TrainerConfig(micro_batch_size=16, mini_batches=2, lr=5e-4, total_steps=steps + 1)
    estimator, backbone = VARIANTS[variant]
    algo = AlgorithmConfig(adv_estimator=estimator, clip_ratio_high=0.28)
    critic = CriticConfig(backbone=backbone, lr=1e-3)
    engine = TrainEngine(model_dir, trainer, algo, temperature=1.0, critic_cfg=critic)
    rows = [engine.train_step(make_batch(vocab, s)) for s in range(steps + 1)][1:]
    models = [engine.model] + ([engine.critic.model] if engine.critic is not None else [])
    params = sum(p.numel() for m in models for p in m.parameters())
    destroy_distributed()
    return {"params": params, **{k: statistics.median(r[k] for r in rows) for k in PARTS if k in rows[0]}}


def table(result: dict, command: str) -> list[str]:
    """The results as Markdown lines: each variant's figure, and its ratio to GRPO's where GRPO has one."""
    out = {v: result[v] for v in VARIANTS}
    g = out["grpo"]

    def cell(v: str, k: str) -> str:
        if k not in out[v]:
            return "-"
        if v == "grpo" or k not in g:
            return f"{out[v][k]:.3f}"
        return f"{out[v][k]:.3f} ({out[v][k] / max(g[k], 1e-9):.2f}x)"

    def row(label: str, key: str) -> str:
        return f"| {label} | " + " | ".join(cell(v, key) for v in VARIANTS) + " |"

    return [
        (
            f"Model: {result['model']}; batch: 4 groups x 8 sequences (quickstart-shaped), 2 updates per step, "
            f"micro-batch 16, one rank, one thread; median of {result['steps']} steps after one warm-up. "
            f"Command: {command}.  "
        ),
        machine_line(result["machine"]),
        "",
        "| | grpo | gae, separate critic | gae, shared head |",
        "|---|---:|---:|---:|",
        "| parameters held | " + " | ".join(f"{out[v]['params']:,}" for v in VARIANTS) + " |",
        row("step s", "timing/step_s"),
        row("of which values s (shared: with the proximal log-probs)", "timing/values_s"),
        row("of which proximal s", "timing/proximal_s"),
        row("of which critic update s", "timing/critic_update_s"),
        row("of which actor update s (shared: with the head's)", "timing/update_s"),
        row("step peak RSS GB", "perf/peak_rss_gb"),
    ]


def main() -> None:
    from rlbus.trainer.dist import spawn_local

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".rlbus/models/tiny-calculator", help="a causal LM directory")
    ap.add_argument("--layers", type=int, default=0, help="> 0: a random Qwen2 of this many layers instead")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--docs", type=Path, default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if args.layers:
            model_dir = str(tiny_qwen2(Path(tmp) / "m", layers=args.layers, hidden=args.hidden, vocab=args.vocab))
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        out = {v: spawn_local(1, _run, model_dir, v, args.steps, vocab)[0] for v in VARIANTS}
    result = {"model": model_dir if not args.layers else f"random Qwen2 {args.layers}x{args.hidden}, vocab "
              f"{args.vocab}", "steps": args.steps, "machine": machine(), **out}  # fmt: skip
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2))
    lines = table(result, f"`.venv/bin/python bench/critic.py {' '.join(sys.argv[1:])}`")
    print("\n".join(lines))
    if args.docs:
        write_section(HEADING, "\n".join(lines) + "\n", args.docs)


if __name__ == "__main__":
    main()
