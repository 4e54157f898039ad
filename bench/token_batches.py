"""Token-budget micro-batches against today's padded ones: padding share and trainer tokens/s of one RL step.

    .venv/bin/python bench/token_batches.py                   # the tiny random Qwen2 (4 x 256, vocab 4096)
    .venv/bin/python bench/token_batches.py --model smollm2   # .rlbus/models/smollm2-135m-instruct

One `TrainEngine.train_step` (FSDP2, world size 1, `off_policy: bypass`: no proximal pass, so the step is the
update's forward and backward plus one AdamW step, the same AdamW on every path) on two batches:

- `spread10x`: 64 samples whose lengths are log-uniform over 32-320 tokens (a 10x spread, most of them short), a
  16-token prompt of their own each;
- `gcd`: the shape of configs/gcd_smollm2.yaml's steps (4 groups of 8; the group's prompt, 75 tokens as SmolLM2's
  chat template makes gcd's, shared by its samples; replies of 8-96 tokens, a quarter cut at 96). Synthetic tokens:
  the lengths are gcd's, not its text.

Paths: `padded` (today's: `trainer.micro_batch_size: 8`, each micro-batch padded to its longest row), `tokens`
(`trainer.micro_batch_tokens`, default 8 x the batch's longest sample: no micro-batch may cost more than the padded
path's worst), `packed` (the same budget with `trainer.pack_samples`). All keep `trainer.share_prefix` (a group's
shared prompt run once per micro-batch where cheaper). Padding share: 1 - the real token-positions the forwards ran
over their rows x row length (as laid out by trainer/packing.py, recorded during the step); tokens/s: the batch's
tokens over the step's median wall time (`--repeats`, after one warm-up step). Writes bench/results/token_batches.json
(`--out`) with the machine's description.
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

import msgspec  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from rlbus.schemas.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from rlbus.trainer import packing  # noqa: E402
from rlbus.trainer.dist import destroy_distributed  # noqa: E402
from rlbus.trainer.engine import TrainEngine  # noqa: E402

from bench.common import git_commit, machine, tiny_qwen2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "token_batches.json"
SMOLLM2 = ROOT / ".rlbus" / "models" / "smollm2-135m-instruct"


def make_batch(lengths: list[int], prompt_lens: list[int], group_size: int, vocab: int, *, shared: bool,
               seed: int = 0) -> TensorDict:  # fmt: skip
    """Right-padded [prompt | reply] rows in the trainer's contract; `shared`: a group's samples share its prompt."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    lengths_B, prompt_B = torch.tensor(lengths), torch.tensor(prompt_lens)
    pos = torch.arange(T)[None]
    attention_mask = (pos < lengths_B[:, None]).long()
    input_ids = torch.randint(2, vocab, (B, T), generator=g)
    if shared:
        first = torch.arange(B) // group_size * group_size
        input_ids = torch.where(pos < prompt_B[:, None], input_ids[first], input_ids)
    response_mask = ((pos >= prompt_B[:, None]) & (pos < lengths_B[:, None])).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths_B - 1] = torch.randint(0, 2, (B,), generator=g).float()
    return TensorDict({
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "position_ids": (pos.expand(B, T) * attention_mask).long(),
        "response_mask": response_mask,
        "rollout_log_probs": -2.0 * response_mask,
        "token_level_rewards": rewards,
        "group_index": torch.arange(B) // group_size,
        "versions": torch.zeros(B, T, dtype=torch.long),
    }, batch_size=[B])  # fmt: skip


def batches(vocab: int) -> dict[str, TensorDict]:
    rng = torch.Generator().manual_seed(1)
    spread = [int(32 * 10 ** float(u)) for u in torch.rand(64, generator=rng)]
    replies = torch.randint(8, 97, (32,), generator=rng)
    replies[torch.rand(32, generator=rng) < 0.25] = 96  # cut at max_response_tokens
    gcd_prompt = 75
    return {
        "spread10x": make_batch(spread, [16] * 64, 8, vocab, shared=False),
        "gcd": make_batch([gcd_prompt + int(r) for r in replies], [gcd_prompt] * 32, 8, vocab, shared=True),
    }


def run_path(model_dir: str, cfg: TrainerConfig, batch: TensorDict, repeats: int) -> dict:
    """Median step time over `repeats` steps (after one warm-up) and the layout of the forwards of one step."""
    engine = TrainEngine(model_dir, cfg, AlgorithmConfig(off_policy="bypass"), temperature=1.0)
    layouts: list[tuple[int, int]] = []  # (real token-positions, rows x row length) of each forward
    plan = packing.plan

    def recorded(*args, **kwargs) -> packing.Packing:  # noqa: ANN002, ANN003
        pack = plan(*args, **kwargs)
        layouts.append((pack.num_positions, pack.input_ids.numel()))
        return pack

    times = []
    packing.plan = recorded
    try:
        for _ in range(repeats + 1):
            layouts.clear()
            t = time.perf_counter()
            engine.train_step(batch)
            times.append(time.perf_counter() - t)
    finally:
        packing.plan = plan
    real, padded = sum(n for n, _ in layouts), sum(n for _, n in layouts)
    tokens = int(batch["attention_mask"].sum())
    step_s = statistics.median(times[1:])
    return {"step_s": step_s, "step_s_all": times[1:], "tokens_per_s": tokens / step_s, "forwards": len(layouts),
            "positions_run": padded, "padding_share": 1 - real / padded, "tokens": tokens}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=int, default=0, help="micro_batch_tokens; 0 = 8 x the batch's longest sample")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", nargs="+", default=["spread10x", "gcd"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"model": args.model, "commit": git_commit(), "threads": args.threads, "repeats": args.repeats,
                     "batches": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            model_dir = str(SMOLLM2)
            vocab = int(json.loads((SMOLLM2 / "config.json").read_text())["vocab_size"])
        else:
            vocab = 4096
            model_dir = str(tiny_qwen2(Path(tmp) / "tiny", layers=4, hidden=256, vocab=vocab))
        for name in args.batches:
            batch = batches(vocab)[name]
            budget = args.budget or 8 * int(batch["attention_mask"].sum(dim=-1).max())
            padded = TrainerConfig(micro_batch_size=8, lr=1e-7)
            paths = {"padded": padded, "tokens": msgspec.structs.replace(padded, micro_batch_tokens=budget),
                     "packed": msgspec.structs.replace(padded, micro_batch_tokens=budget, pack_samples=True)}
            row = {"budget": budget, "samples": int(batch.batch_size[0]), "paths": {}}
            for path, cfg in paths.items():
                row["paths"][path] = run_path(model_dir, cfg, batch, args.repeats)
                r = row["paths"][path]
                print(f"{name:10s} {path:7s} padding {r['padding_share']:6.1%}  {r['tokens_per_s']:9,.0f} tokens/s  "
                      f"({r['forwards']} forwards, {r['positions_run']} positions, median {r['step_s']:.3f} s)")
            base = row["paths"]["padded"]["tokens_per_s"]
            row["speedup"] = {p: r["tokens_per_s"] / base for p, r in row["paths"].items() if p != "padded"}
            results["batches"][name] = row
    destroy_distributed()
    results["machine"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
