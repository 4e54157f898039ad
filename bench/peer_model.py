"""The model of `bench/peer_trl.py`: a 0.8M-parameter Qwen2 that adds two-digit numbers right some of the time.

    .venv/bin/python bench/peer_model.py OUT_DIR [--target 0.2] [--max-steps 3000]     (or bench/peer_trl.py --setup)

Built with rlbus's own tools in two stages: `common/model/init_model.py` (the quickstart's tokenizer, digits one per
token, and its Qwen2 classes at hidden 128 / 4 layers; 400 warm-start steps on direct-answer demonstrations), then
supervised steps on direct answers to two-digit sums only, stopped as soon as sampled accuracy (temperature 1, at
most 8 new tokens, the reward of bench/peer_task.py) on held-out sums reaches `--target`. So RL starts from a
policy that is right on some sums and has something to climb, as a practitioner's warm start would; the stop rule
and the measured accuracy are written to OUT_DIR/peer_model.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

import torch

from bench.peer_task import TWO_DIGITS, add_operands_arg, messages, problems, score

#: The peer model's shape: the quickstart's classes, 6.5x its width x depth (837,760 parameters).
SPEC = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4}
WARM_STEPS = 400
EVAL_SEED = 10_000  # held-out sums (the bench's data uses seed 0)


def _batch(tokenizer, rng: random.Random, size: int, operands: tuple[int, int] = TWO_DIGITS,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from rlbus.common.model.demos import answer_text
    from rlbus.common.model.warm_start import encode_demonstration

    seqs = []
    for _ in range(size):
        a, b = rng.randint(*operands), rng.randint(*operands)
        conv = [*messages(f"What is {a}+{b}?"), {"role": "assistant", "content": answer_text(str(a + b))}]
        seqs.append(encode_demonstration(tokenizer, conv))
    width = max(len(ids) for ids, _ in seqs)
    pad = tokenizer.pad_token_id or 0
    ids_BT = torch.full((size, width), pad, dtype=torch.long)
    attn_BT = torch.zeros((size, width), dtype=torch.long)
    labels_BT = torch.full((size, width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(seqs):
        n = len(ids)
        ids_BT[i, :n] = torch.tensor(ids)
        attn_BT[i, :n] = 1
        labels_BT[i, :n] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
    return ids_BT, attn_BT, labels_BT


@torch.no_grad()
def sampled_accuracy(model, tokenizer, num: int = 128, seed: int = EVAL_SEED,
                     operands: tuple[int, int] = TWO_DIGITS) -> float:
    """Mean peer reward of one sample (temperature 1, 8 new tokens) per held-out sum."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    total = 0.0
    for q, a in problems(num, seed, operands):
        enc = tokenizer.apply_chat_template(messages(q), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                             pad_token_id=tokenizer.pad_token_id)
        total += score(tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=False), a)
    model.train()
    return total / num


def build(out: Path, *, target: float | None = 0.2, max_steps: int = 3000, eval_every: int = 100, lr: float = 3e-3,
          batch_size: int = 32, seed: int = 0, start_from: Path | None = None,
          operands: tuple[int, int] = TWO_DIGITS, log=print) -> Path:
    """Stage 1 (init_model) then stage 2 (the addition drill); `start_from` is a stage-1 directory to reuse.

    The drill stops at `target` sampled accuracy (checked every `eval_every` steps) or after `max_steps`; with
    target None it runs exactly `max_steps`, so the model does not hinge on where a noisy accuracy check lands."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.common.model.init_model import init_model
    from rlbus.common.model.tiny import TinyModelSpec
    from rlbus.common.model.warm_start import WarmStartConfig

    torch.set_num_threads(2)
    started = time.perf_counter()
    if start_from is not None:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(start_from, out)
    else:
        init_model(out, steps=WARM_STEPS, force=True, spec=TinyModelSpec(**SPEC), seed=seed,
                   warm=WarmStartConfig(tool_fraction=0.0, drill_batch_size=0, log_every=100,
                                       check_target=0.0), num_threads=2, log=log)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng = random.Random(seed + 1)
    history = [(0, sampled_accuracy(model, tokenizer, operands=operands))]
    log(f"addition drill: step 0, sampled accuracy {history[-1][1]:.3f}")
    step = 0
    while (target is None or history[-1][1] < target) and step < max_steps:
        for _ in range(min(eval_every, max_steps - step)):
            ids_BT, attn_BT, labels_BT = _batch(tokenizer, rng, batch_size, operands)
            logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT).logits.float()
            loss = torch.nn.functional.cross_entropy(logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]),
                                                     labels_BT[:, 1:].reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
        history.append((step, sampled_accuracy(model, tokenizer, operands=operands)))
        log(f"addition drill: step {step}, loss {loss.item():.3f}, sampled accuracy {history[-1][1]:.3f} "
            f"({time.perf_counter() - started:.0f}s)")
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "peer_model.json").write_text(json.dumps({
        "spec": SPEC, "warm_steps": WARM_STEPS, "drill_steps": step, "drill_lr": lr, "drill_batch_size": batch_size,
        "target": target, "operands": list(operands), "accuracy_history": history,
        "seconds": round(time.perf_counter() - started, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }, indent=1) + "\n")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--target", type=float, default=0.2)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-from", default="", help="reuse this stage-1 (init_model) directory")
    add_operands_arg(ap, "the range both numbers of a drilled sum are drawn from")
    ap.add_argument("--eval-every", type=int, default=100, help="drill steps between accuracy checks")
    args = ap.parse_args()
    print(build(Path(args.out), target=args.target, max_steps=args.max_steps, seed=args.seed,
                start_from=Path(args.start_from) if args.start_from else None, operands=tuple(args.operands),
                eval_every=args.eval_every))
