"""`rlbus config prompts CONFIG [overrides] [--heldout] [--num N] [--json]`: the prompts a run trains on, or the
held-out ones its evaluator scores, as the feeder and the evaluator load them (common/envs), without starting
anything.

With `--heldout` it also says how many held-out prompts appear among the training prompts (by their text: the
messages and the ground truth), which should be none: the evaluator's split is built apart from the training set
(another seed of the synthetic generator, the environment's own held-out split, `data.val_path`).
"""

from __future__ import annotations

import argparse
import json
import sys

from rlbus.common.data.datasets import Example


def _key(ex: Example) -> tuple:
    return tuple((m.role, m.content) for m in ex.prompt) + (ex.ground_truth,)


def _question(ex: Example) -> str:
    users = [m.content for m in ex.prompt if m.role == "user"]
    return (users[-1] if users else ex.prompt[-1].content).replace("\n", " ")


def cmd_config_prompts(args: argparse.Namespace) -> int:
    from rlbus.common.envs import load_heldout_tasks, load_tasks
    from rlbus.schemas.config_io import load_config

    cfg = load_config(args.config, args.overrides)
    train = load_tasks(cfg)
    shown = load_heldout_tasks(cfg, args.num or cfg.eval.num_prompts) if args.heldout else train
    limit = len(shown) if args.heldout or not args.num else min(args.num, len(shown))
    for ex in list(shown)[:limit]:
        if args.json:
            print(json.dumps({"index": ex.index, "prompt": [{"role": m.role, "content": m.content} for m in ex.prompt],
                              "ground_truth": ex.ground_truth, "data_source": ex.data_source}))
        else:
            print(f"{ex.index:>6}  {_question(ex)[:100]:<100}  -> {ex.ground_truth}")
    summary = f"{shown.name}: {limit} of {len(shown)} prompt(s) shown"
    if args.heldout:
        seen = {_key(ex) for ex in train}
        overlap = [ex.index for ex in shown if _key(ex) in seen]
        summary += (f"; {len(overlap)} of them among the {len(train)} training prompts"
                    + (f" (held-out indices {overlap[:10]})" if overlap else ""))
    print(summary, file=sys.stderr)
    return 0


def add_parser(config_sub, with_config) -> None:
    sp = with_config(config_sub.add_parser(
        "prompts", help="list the training prompts, or the evaluator's held-out ones (and whether any is in training)"))
    sp.add_argument("--heldout", action="store_true", help="the evaluator's held-out prompts (eval.num_prompts)")
    sp.add_argument("--num", type=int, default=0, help="how many (training: the first N; held-out: N instead of "
                                                       "eval.num_prompts)")
    sp.add_argument("--json", action="store_true", help="one JSON object per prompt")
    sp.set_defaults(func=cmd_config_prompts)
