"""What the adapted layers cost a LoRA step: a forward and backward of SmolLM2-135M-Instruct, peft's `Linear` against
trainer/lora_linear.py's, beside full fine-tuning and a frozen model with no adapter at all (what LoRA could cost at
best), interleaved in one process so that a busy machine slows every variant alike.

    flock /tmp/rlbus-heavy.lock .venv/bin/python bench/lora_layer.py --rounds 8 [--docs]

Each variant is its own copy of the model (float32, eval mode as the trainer's update, 2 threads). One pass: a
micro-batch of 8 sequences of 160 random tokens, the model's forward, the output head at the last 64 positions (the
response), a log-softmax loss, backward, gradients dropped. Every round runs each variant once, in turn; the table
gives the median and range over rounds and, per round, the ratio to full fine-tuning's pass of the same round.
LoRA is rank 8 on every linear layer, alpha 16, B drawn non-zero (as after training). bench/lora.py measures whole
trainer steps, one variant per process.

Writes bench/results/lora_layer.json and, with --docs, the section "LoRA's adapted layers" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

import torch  # noqa: E402

from bench.common import git_commit, machine, machine_line, peft_lora_forward, write_section  # noqa: E402
from bench.weights import model_dir as smollm2_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "lora_layer.json"
HEADING = "## LoRA's adapted layers"
VARIANTS = ("full", "frozen", "lora_peft", "lora_rlbus")
RANK, BATCH, LENGTH, SCORED = 8, 8, 160, 64


def build(path: str, variant: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from rlbus.schemas.lora import LoraConfig
    from rlbus.trainer import lora

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if variant == "frozen":  # no adapter, every weight frozen: the hidden states still carry gradients
        model.requires_grad_(False)
        model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
    elif variant.startswith("lora"):
        with peft_lora_forward(variant == "lora_peft"):
            lora.apply_lora(model, LoraConfig(rank=RANK, alpha=2.0 * RANK))
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.data.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return model


def one_pass(model: torch.nn.Module, ids: torch.Tensor) -> float:
    t = time.perf_counter()
    hidden = model.model(input_ids=ids).last_hidden_state[:, -SCORED:]
    logp = torch.log_softmax(model.lm_head(hidden), dim=-1)
    logp.gather(-1, ids[:, -SCORED:, None]).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def report(res: dict) -> str:
    rows = res["passes"]
    lines = [
        HEADING, "",
        (f"One forward and backward of SmolLM2-135M-Instruct (float32) over {BATCH} sequences of {LENGTH} tokens, "
         f"the output head at the last {SCORED}: full fine-tuning, every weight frozen with no adapter (the least a "
         f"LoRA pass could cost), and LoRA rank {RANK} on every linear layer through peft's `Linear` and through "
         "trainer/lora_linear.py's, each its own model in one process, interleaved round by round; median [min-max] "
         f"over {len(rows['full'])} rounds, and the median of each round's ratio to full fine-tuning's pass. "
         f"Command: `{res['command']}`; rlbus at `{res['commit']}`.  "),
        machine_line(res["machine"]), "",
        "| variant | pass s | full's pass / this pass (per round) |", "|---|---:|---:|",
    ]
    for v in VARIANTS:
        xs = rows[v]
        ratio = statistics.median(f / x for f, x in zip(rows["full"], xs))
        lines.append(f"| {v} | {statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}] | {ratio:.2f}x |")
    peft_ours = statistics.median(p / o for p, o in zip(rows["lora_peft"], rows["lora_rlbus"]))
    lines += ["", f"peft's pass over rlbus's, per round: {peft_ours:.2f}x (median). Results: `bench/results/"
              f"{RESULTS.name}`.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", action="store_true", help="write the section into docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = str(smollm2_dir())
    models = {v: build(path, v) for v in VARIANTS}
    ids = torch.randint(0, models["full"].config.vocab_size, (BATCH, LENGTH))
    for m in models.values():  # warm-up
        one_pass(m, ids)
    passes: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # neither variant always follows the same one
        for v in order:
            passes[v].append(round(one_pass(models[v], ids), 4))
    res = {"command": "python bench/lora_layer.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
           "machine": machine(), "date": time.strftime("%Y-%m-%d"), "passes": passes}  # fmt: skip
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    text = report(res)
    print(text)
    if args.docs:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
