"""The quickstart model's warm start written as a supervised phase of the trainer (`trainer.sft`), not its own loop.

common/model/warm_start.py trains the tiny model with a loop of its own: 1000 steps, each on 16 fresh calculator
demonstrations and 32 copy drills, then checks what it is for (`tool_copy_check`: the teacher-forced probability of
copying the question into the call and the tool's result into the answer, target 0.95). Here the same stream of
conversations is written to a JSONL file in step order (step k's 48 conversations are rows 48(k-1) ... 48k-1, the
very ones the warm start's first attempt draws from `random.Random(seed)`), and the trainer's SFT phase trains the
same initial weights on it (`shuffle: false`, batch 48, the warm start's LR schedule, AdamW betas and weight decay)
through the FSDP2 engine on one rank, in this process (no bus, no Ray: the phase needs neither). Then the same check.

Differences, all the trainer's: its loss is the token mean over the step's 48 conversations, where the warm start
adds the demonstrations' token mean and the drills' (about 270 and 314 assistant tokens a step: per token a drill
weighs 0.86x a demonstration there, 1x here, and the gradient is about twice as large there, so clipped at 1.0
more often); torch's sdpa attention and the fused AdamW, where the warm start runs eager attention and the default
kernel; and one attempt, where the warm start tries other streams while it misses the target. The shipped model's
bytes and configs/quickstart.yaml are untouched: this builds a model beside them, for comparison.

    .venv/bin/python bench/warm_start_sft.py --out runs/warm-start-sft        # about 2-5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from rlbus.common.model.demos import arithmetic_problem, demonstration
from rlbus.common.model.warm_start import WarmStartConfig, copy_drill, tool_copy_check

SHIPPED_REPORT = Path(__file__).resolve().parents[1] / "common/model/shipped/tiny-calculator/warm_start.json"


def write_stream(path: Path, cfg: WarmStartConfig) -> int:
    """The warm start's first-attempt stream of conversations, one step's after another; returns the batch size."""
    rng = random.Random(cfg.seed)  # warm_start._stream_seed(seed, 0): the first attempt's stream
    with path.open("w") as f:
        for _ in range(cfg.steps):
            convs = []
            for _ in range(cfg.batch_size):  # warm_start.demo_batch draws in this order
                question, answer = arithmetic_problem(rng)
                convs.append(demonstration(question, answer, use_tool=rng.random() < cfg.tool_fraction))
            convs += [copy_drill(rng) for _ in range(cfg.drill_batch_size)]  # then drill_batch
            f.write("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    return cfg.batch_size + cfg.drill_batch_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for the data, the model and result.json")
    p.add_argument("--seed", type=int, default=1, help="initial weights and stream (the shipped model's: 1)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from rlbus.common.model.tiny import tiny_model
    from rlbus.common.model.tokenizer import build_tokenizer
    from rlbus.schemas.config import ModelConfig, RunConfig, TrainerConfig
    from rlbus.schemas.sft import SftConfig
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine
    from rlbus.trainer.sft import SftRunner

    torch.set_num_threads(args.threads)
    warm = WarmStartConfig(steps=args.steps, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    initial, final = args.out / "initial", args.out / "model"
    tok = build_tokenizer()
    tiny_model(tok, seed=args.seed).save_pretrained(initial)  # init_model's initial weights
    tok.save_pretrained(initial)
    data = args.out / "warm_start.jsonl"
    batch = write_stream(data, warm)
    sft = SftConfig(data=str(data), steps=warm.steps, batch_size=batch, shuffle=False, max_length=512, lr=warm.lr,
                    lr_schedule="cosine", warmup_steps=warm.warmup_steps, min_lr_ratio=warm.min_lr_ratio)
    cfg = RunConfig(model=ModelConfig(path=str(initial)),
                    trainer=TrainerConfig(micro_batch_size=batch, betas=(0.9, 0.98), weight_decay=warm.weight_decay,
                                          grad_clip=1.0, share_prefix=False, sft=sft))  # fmt: skip
    init_distributed("cpu")
    runner = SftRunner(TrainEngine.from_config(cfg), cfg, tok)
    t0 = time.perf_counter()
    losses = []
    for k in range(1, runner.num_steps + 1):
        losses.append(runner.step(k)["sft/loss"])
        if k % 100 == 0:
            print(f"sft step {k}/{runner.num_steps}: loss {sum(losses[-100:]) / 100:.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    seconds = time.perf_counter() - t0
    weights = runner.engine.full_state_dict()
    destroy_distributed()
    model = AutoModelForCausalLM.from_pretrained(initial)
    model.load_state_dict(weights)
    model.save_pretrained(final)
    tok.save_pretrained(final)
    check = tool_copy_check(model, tok)
    shipped = json.loads(SHIPPED_REPORT.read_text())["checks"][0]
    result = {"seed": args.seed, "steps": runner.num_steps, "seconds": round(seconds, 1),
              "final_loss": sum(losses[-50:]) / len(losses[-50:]), "check": {"call": check.call,
              "answer": check.answer, "tool_ok": check.tool_ok}, "target": warm.check_target,
              "passed": check.tool_ok >= warm.check_target, "shipped_warm_start_check": shipped}  # fmt: skip
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
