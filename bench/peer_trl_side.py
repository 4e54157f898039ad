"""The TRL side of `bench/peer_trl.py`: TRL's GRPOTrainer on the peer task, one process, timed.

Run only by the TRL venv's python (`.bench/trl-venv`, made by `bench/peer_trl.py --setup`); it imports trl,
transformers and torch from there and, from this repository, only `bench/peer_task.py` (standard library). On an
environment's task (bench/peer_env.py: --prompts-file, --score-cmd) the prompts come from a file and every
completion's reward from a scoring process in rlbus's venv (bench/env_score.py), so neither needs rlbus here.

    .bench/trl-venv/bin/python bench/peer_trl_side.py --model DIR --out OUT.json --seed 0 [--steps 100] ...

Writes OUT.json: the wall-clock stamps of the process start, of the end of imports, of the trainer built and of
every logged step (time.time()), each step's mean reward, the models saved (--save-at) with the moment each step's
weights existed, and the settings. Every setting that differs from
GRPOConfig's defaults is set to what the rlbus side runs: fp32 (no bf16 on CPU), no gradient checkpointing, a
constant learning rate, no KL (beta 0, TRL's default), one update per generation batch (num_iterations 1, TRL's
default; so its clipped ratio is 1, as rlbus's is with mini_batches 1), token-mean loss ("dapo", TRL's default,
= rlbus's loss_agg_mode token-mean), grad-norm clip 1.0 (both defaults).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench.peer_task

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from bench.peer_task import SCORES, SYSTEM_PROMPT, add_operands_arg, messages, problems

T_IMPORTED = time.time()


class StepStamps(TrainerCallback):
    """Stamps every optimizer step as it ends and keeps the reward TRL logs for it (logging_steps=1); after the
    steps in `save_at`, saves the model (OUT/step_N) and stamps the moment its weights existed, before the save."""

    def __init__(self, folder: Path, save_at: set[int], tokenizer) -> None:
        self.steps: list[dict] = []
        self.saved: list[dict] = []
        self.folder, self.save_at, self.tokenizer = folder, save_at, tokenizer

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.save_at:
            t = time.time()
            path = self.folder / f"step_{state.global_step}"
            model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            self.saved.append({"step": state.global_step, "t": t, "path": str(path)})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.steps.append({"step": state.global_step, "t": time.time(), "reward": float(logs["reward"]),
                               "entropy": float(logs.get("entropy", float("nan")))})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default (every core)")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--system", default=SYSTEM_PROMPT, help="the prompts' system message")
    ap.add_argument("--reward", choices=sorted(SCORES), default="first")
    add_operands_arg(ap)
    # An environment's task (bench/peer_env.py): its prompts and its reward come from rlbus's own code, run apart.
    ap.add_argument("--prompts-file", default="", help="JSONL of {index, prompt} (bench/env_score.py --dump-train)")
    ap.add_argument("--score-cmd", default="", help="JSON argv of the scoring process (bench/env_score.py)")
    ap.add_argument("--save-at", type=int, nargs="*", default=[], help="steps after which the model is saved")
    ap.add_argument("--epsilon-high", type=float, default=None, help="the clip's upper bound (default: TRL's)")
    ap.add_argument("--lora-rank", type=int, default=0, help="> 0: a LoRA adapter of this rank (alpha 2 x rank) on "
                    "every linear layer, through GRPOTrainer's peft_config")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # Conversational prompts: TRL renders them with the tokenizer's chat template (the quickstart's ChatML), the
    # same token ids rlbus's producers make (bench/peer_trl.py checks it).
    if args.prompts_file:
        rows = [{"prompt": r["prompt"], "index": r["index"]}
                for r in map(json.loads, Path(args.prompts_file).read_text().splitlines())]
        scorer = subprocess.Popen(json.loads(args.score_cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def reward(completions, index, **kwargs):
            for c, i in zip(completions, index):
                scorer.stdin.write(json.dumps({"index": i, "text": c[0]["content"]}) + "\n")
            scorer.stdin.flush()
            return [json.loads(scorer.stdout.readline())["reward"] for _ in completions]
    else:
        rows = [{"prompt": messages(q, args.system), "truth": a}
                for q, a in problems(args.prompts * args.steps * 2, args.data_seed, tuple(args.operands))]
        score = SCORES[args.reward]

        def reward(completions, truth, **kwargs):
            return [score(c[0]["content"], t) for c, t in zip(completions, truth)]
    dataset = Dataset.from_list(rows)

    batch = args.prompts * args.n
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix("")) + "-trl-out",
        seed=args.seed, data_seed=args.seed, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=args.n, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="dapo", scale_rewards="group",
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
        **({"epsilon_high": args.epsilon_high} if args.epsilon_high is not None else {}),
    )
    stamps = StepStamps(Path(args.out).with_suffix(""), set(args.save_at), tokenizer)
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, bias="none",
                                 task_type="CAUSAL_LM", target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[stamps], peft_config=peft_config)
    t_built = time.time()
    trainer.train()
    t_end = time.time()
    Path(args.out).write_text(json.dumps({
        "t_start": T_START, "t_imported": T_IMPORTED, "t_built": t_built, "t_end": t_end,
        "steps": stamps.steps, "saved": stamps.saved, "torch_threads": torch.get_num_threads(), "pid": os.getpid(),
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                     "torch": torch.__version__,
                     **({"peft": __import__("peft").__version__} if args.lora_rank else {})},
        "settings": vars(args),
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
