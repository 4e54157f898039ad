"""Trainer throughput: one RL step through TrainEngine (FSDP2, world size 1) against a plain PyTorch loop.

    .venv/bin/python bench/trainer.py [--layers 4 --hidden 256 --vocab 4096 --batch 16 --seq 256 --steps 3]

Both sides run the same model, batch, PPO loss, grad clip and AdamW, in this one process; the plain loop has no
FSDP and does one forward/backward over the whole batch. Also times `full_state_dict()` (the weight-publishing
gather) against copying the same bytes once. Prints a table; writes bench/results/trainer.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from rlbus.schemas.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from rlbus.trainer import algorithms as A  # noqa: E402
from rlbus.trainer.dist import destroy_distributed  # noqa: E402
from rlbus.trainer.engine import TrainEngine, token_log_probs  # noqa: E402

from bench.common import machine, tiny_qwen2  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "trainer.json"


def make_batch(B: int, T: int, vocab: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    pos = torch.arange(T)[None]
    attention_mask = (pos < lengths[:, None]).long()
    response_mask = ((pos >= 32) & (pos < lengths[:, None])).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
    return TensorDict(
        {
            "input_ids": torch.randint(0, vocab, (B, T), generator=g) * attention_mask,
            "attention_mask": attention_mask,
            "position_ids": (pos.expand(B, T) * attention_mask).long(),
            "response_mask": response_mask,
            "rollout_log_probs": -2.0 * response_mask,
            "token_level_rewards": rewards,
            "group_index": torch.arange(B) // 4,
            "versions": torch.zeros(B, T, dtype=torch.long),
        },
        batch_size=[B],
    )


def plain_steps(model_dir: Path, batch: TensorDict, cfg: TrainerConfig, steps: int) -> list[float]:
    """The baseline: the same step as a bare PyTorch loop (no FSDP, one forward/backward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    mask = batch["response_mask"]
    times = []
    for _ in range(steps + 1):  # the first is warm-up
        t = time.perf_counter()
        adv = A.compute_advantages(batch["token_level_rewards"], mask, batch["group_index"])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits  # fmt: skip
        logp = token_log_probs(logits, batch["input_ids"], 1.0)
        tokens, seqs = A.LossNormaliser.local_counts(mask)
        out = A.ppo_clip_loss(logp, batch["rollout_log_probs"], adv, mask,
                              norm=A.LossNormaliser(num_tokens=tokens, num_seqs=seqs))  # fmt: skip
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = TrainerConfig(micro_batch_size=args.batch, lr=1e-5)
    algo_cfg = AlgorithmConfig(off_policy="bypass")  # the plain loop recomputes nothing either
    batch = make_batch(args.batch, args.seq, args.vocab)
    num_tokens = int(batch["attention_mask"].sum())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        tiny_qwen2(model_dir, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        plain = plain_steps(model_dir, batch, cfg, args.steps)
        engine = TrainEngine(str(model_dir), cfg, algo_cfg, temperature=1.0)
        engine_times = []
        for _ in range(args.steps + 1):
            t = time.perf_counter()
            engine.train_step(batch)
            engine_times.append(time.perf_counter() - t)
        engine_times = engine_times[1:]

        gather, copy = [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            sd = engine.full_state_dict()
            gather.append(time.perf_counter() - t)
            # The floor: every parameter byte copied once (what publishing must do at the very least).
            params = [p.detach().full_tensor() for p in engine.model.parameters()]
            t = time.perf_counter()
            _ = [p.clone() for p in params]
            copy.append(time.perf_counter() - t)
        num_bytes = sum(p.numel() * p.element_size() for p in params)
        num_params = sum(p.numel() for p in params)
        del sd
        destroy_distributed()

    plain_tps = num_tokens / statistics.median(plain)
    engine_tps = num_tokens / statistics.median(engine_times)
    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "params": num_params},
        "batch": {"sequences": args.batch, "seq_len": args.seq, "tokens": num_tokens},
        "threads": args.threads,
        "plain_tokens_per_s": plain_tps,
        "engine_tokens_per_s": engine_tps,
        "engine_over_plain": engine_tps / plain_tps,
        "full_state_dict_s": statistics.median(gather),
        "copy_once_s": statistics.median(copy),
        "full_state_dict_over_copy": statistics.median(gather) / max(statistics.median(copy), 1e-9),
        "state_bytes": num_bytes,
        "machine": machine(),
    }
    table = Table(title=f"trainer step: {num_params / 1e6:.1f}M params, {num_tokens} tokens, {args.threads} thread(s)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("plain PyTorch loop, tokens/s", f"{plain_tps:,.0f}")
    table.add_row("TrainEngine (FSDP2, 1 rank), tokens/s", f"{engine_tps:,.0f}")
    table.add_row("engine / plain (target >= 0.9)", f"{result['engine_over_plain']:.2f}")
    table.add_row(f"full_state_dict ({num_bytes / 2**20:.1f} MiB), ms", f"{result['full_state_dict_s'] * 1e3:.1f}")
    table.add_row("copy the same bytes once, ms", f"{result['copy_once_s'] * 1e3:.1f}")
    table.add_row("full_state_dict / copy", f"{result['full_state_dict_over_copy']:.1f}x")
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
