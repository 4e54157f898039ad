"""The TRL side of `bench/peer_update.py`: TRL's GRPO loss and optimizer on batches rlbus's trainer recorded.

Run only by the TRL venv's python (`.bench/trl-venv`, made by `bench/peer_trl.py --setup`); it imports trl,
transformers, torch and safetensors from there and nothing from rlbus.

    .bench/trl-venv/bin/python bench/peer_update_trl.py --model DIR --exchange DIR --steps N [--lr 2e-4]

EXCHANGE holds, for each recorded step k = 1..N, `batch_k.safetensors` (the step's batch in rlbus's layout:
input_ids, attention_mask, response_mask, token_level_rewards, group_index) and `rlbus_before_k.safetensors`
(rlbus's weights before the step). For each step this writes to EXCHANGE:

    trl_grad_k_eps<E>.safetensors  TRL's gradient (after its grad-norm clip) at rlbus's weights before step k, with
                                   GRPO's advantages scaled by std + E: E = 1e-4 (TRL's) and 1e-6 (rlbus's, verl's)
    trl_after_k.safetensors        the weights of TRL's own run fed the same batches from the same start (its loss,
                                   its clip, its AdamW)
    trl_steps.json                 per step: TRL's loss, grad norm before the clip, tokens

The loss is GRPOTrainer.compute_loss itself on inputs in its layout (prompt_ids / prompt_mask / completion_ids /
completion_mask / advantages / num_items_in_batch); the advantages are computed with its own nanstd, as
`_generate_and_score_completions` does; the optimizer is the one GRPOTrainer.create_optimizer builds from the
config; the clip is torch's clip_grad_norm_, which is what accelerate's clip calls on one CPU process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer
from trl.trainer.utils import nanstd

EPSILONS = (1e-4, 1e-6)  # TRL's std epsilon, then verl's and rlbus's


def trl_inputs(batch: dict[str, torch.Tensor], pad_id: int, eps: float) -> dict[str, torch.Tensor]:
    """One rlbus batch (prompt then response per row, right-padded) in GRPOTrainer's layout: prompts left-padded,
    completions right-padded, and GRPO's group-scaled advantages as TRL computes them."""
    rows = []
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        resp = torch.nonzero(batch["response_mask"][i, :n] > 0).flatten()
        p = int(resp[0])
        if int(resp[-1]) != n - 1 or len(resp) != n - p:
            raise ValueError(f"row {i}: not one prompt then one generated response (single-turn only)")
        reward = float(batch["token_level_rewards"][i].sum())
        rows.append((batch["input_ids"][i, :p], batch["input_ids"][i, p:n], reward))
    P = max(len(r[0]) for r in rows)
    C = max(len(r[1]) for r in rows)
    B = len(rows)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    completion_ids = torch.full((B, C), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((B, C), dtype=torch.long)
    for i, (prompt, completion, _) in enumerate(rows):
        prompt_ids[i, P - len(prompt):] = prompt
        prompt_mask[i, P - len(prompt):] = 1
        completion_ids[i, :len(completion)] = completion
        completion_mask[i, :len(completion)] = 1
    rewards = torch.tensor([r[2] for r in rows])
    # GRPO's advantages, grouped by rlbus's group index (TRL's own rows come in blocks of num_generations).
    group = batch["group_index"]
    advantages = torch.zeros(B)
    for g in group.unique():
        members = group == g
        r = rewards[members]
        advantages[members] = (r - torch.nanmean(r)) / (nanstd(r) + eps)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": completion_mask.sum().float()}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--exchange", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (GRPOConfig.num_generations)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ex = Path(args.exchange)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    own = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    probe = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    first = load_file(str(ex / "batch_1.safetensors"))
    config = GRPOConfig(
        output_dir=str(ex / "trl-out"), learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=first["input_ids"].shape[0],
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=args.n, beta=0.0, num_iterations=1,
        loss_type="dapo", scale_rewards="group", temperature=1.0, bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    # The trainer is built for its loss and optimizer only; nothing here generates or scores, so its dataset and
    # reward function are never called.
    trainer = GRPOTrainer(model=own, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                          train_dataset=Dataset.from_list([{"prompt": "unused"}]), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    # The trainer patched its own model's forward to return log-probs through its chunked (fused) LM head; the
    # probe gets the same patch, so both score tokens with TRL's code.
    grpo_trainer.add_fused_lm_head(probe, temperature=trainer.temperature,
                                   cast_lm_head_to_fp32=config.cast_lm_head_to_fp32, outputs=("log_probs", "entropy"))
    model = trainer.model
    model.train()
    probe.train()
    optimizer = trainer.create_optimizer()
    steps = []
    for k in range(1, args.steps + 1):
        batch = load_file(str(ex / f"batch_{k}.safetensors"))
        # (1) TRL's gradient at rlbus's weights before step k, with either epsilon.
        probe.load_state_dict(load_file(str(ex / f"rlbus_before_{k}.safetensors")), strict=False)
        row = {"step": k}
        inputs = {eps: trl_inputs(batch, tokenizer.pad_token_id, eps) for eps in EPSILONS}
        for eps in EPSILONS:
            probe.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(probe, inputs[eps])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(probe.parameters(), config.max_grad_norm)
            save_file(grads(probe), str(ex / f"trl_grad_{k}_eps{eps:g}.safetensors"))
            row[f"loss_eps{eps:g}"] = float(loss.detach())
            row[f"grad_norm_eps{eps:g}"] = float(norm)
        # (2) TRL's own run on the same batches: its weights, its AdamW.
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs[EPSILONS[0]])
        loss.backward()
        row["own_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        optimizer.step()
        save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters()},
                  str(ex / f"trl_after_{k}.safetensors"))
        row["tokens"] = int(inputs[EPSILONS[0]]["num_items_in_batch"])
        steps.append(row)
    (ex / "trl_steps.json").write_text(json.dumps({
        "steps": steps,
        "optimizer": {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.param_groups[0].items()
                      if k != "params"},
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                     "torch": torch.__version__},
    }, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
