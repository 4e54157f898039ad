"""An environment's reward as a line-oriented service, for a peer trained in another Python (bench/peer_env.py).

    .venv/bin/python bench/env_score.py CONFIG [k=v ...] --dump-train PROMPTS.jsonl   # the training prompts, once
    .venv/bin/python bench/env_score.py CONFIG [k=v ...]                             # then: score on stdin

The peer (TRL's GRPOTrainer, in its own venv, without rlbus) trains on the prompts rlbus's producers would send
(the config's `env`, training split, as chat messages) and asks this process for each completion's reward: one
JSON line `{"index": I, "text": COMPLETION}` in, one `{"reward": R}` out, where I is the example's position in the
dump and R what a producer scores (the environment's scorer, `rollout.format_reward` included). One scorer, one
reward: the two sides of a comparison cannot differ in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from transformers import AutoTokenizer

from rlbus.common.data.datasets import example_to_task
from rlbus.common.envs import load_tasks
from rlbus.producers.rewards.registry import env_reward
from rlbus.schemas.config_io import load_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="config overrides k=v")
    ap.add_argument("--dump-train", default="", help="write the training prompts (JSONL) and exit")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    examples = list(load_tasks(cfg, AutoTokenizer.from_pretrained(cfg.model.path)))  # what the feeder releases
    if args.dump_train:
        with open(args.dump_train, "w") as f:
            for i, ex in enumerate(examples):
                f.write(json.dumps({"index": i, "prompt": [{"role": m.role, "content": m.content} for m in ex.prompt],
                                    "answer": ex.ground_truth}) + "\n")
        print(f"{len(examples)} training prompts -> {args.dump_train}", file=sys.stderr)
        return 0
    reward = env_reward(cfg)
    tasks = [example_to_task(ex, task_id=f"t{i}", n=cfg.rollout.n) for i, ex in enumerate(examples)]
    for line in sys.stdin:
        if not line.strip():
            continue
        asked = json.loads(line)
        task = tasks[int(asked["index"])]
        value = asyncio.run(reward(asked["text"], task.ground_truth, task=task))
        sys.stdout.write(json.dumps({"reward": value}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
