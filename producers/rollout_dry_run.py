"""`rlbus rollout CONFIG --num-prompts N`: run the agent loop on a few prompts and show every trajectory.

No bus, no Ray, no trainer: the config's model, engine, tools, reward and data set, exactly as a producer would
build them, on N prompts. Each trajectory is printed with its turns, tool calls and results, reward, and the
response mask over its tokens (generated tokens highlighted, environment-inserted tokens dimmed) -- the quickest
way to check a new reward, tool or chat template before spending compute on a run.

    rlbus rollout configs/quickstart.yaml --num-prompts 2 rollout.n=2
    .venv/bin/python -m rlbus.producers.rollout_dry_run configs/quickstart.yaml --num-prompts 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rlbus.common.data import DataError, example_to_task
from rlbus.common.envs import env_type, load_tasks
from rlbus.producers.agent_loops import Trajectory
from rlbus.producers.agent_loops.tool import ToolAgentLoop
from rlbus.producers.build import build_rollout
from rlbus.schemas.config import RunConfig
from rlbus.schemas.config_io import load_config
from rlbus.schemas.errors import ConfigError

_ROLE_STYLE = {"system": "magenta", "user": "cyan", "assistant": "bold green", "tool": "yellow"}
_GENERATED = "bold black on green3"
_INSERTED = "dim"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbus rollout", description="Run the agent loop on a few prompts and show every "
                                "trajectory (no bus, no Ray).")
    p.add_argument("config", help="YAML run config (e.g. configs/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides, applied in order (e.g. rollout.n=2)")
    p.add_argument("--num-prompts", type=int, default=2, help="prompts to roll out (each rollout.n times)")
    p.add_argument("--seed", type=int, default=0, help="picks the prompts and seeds the sampling")
    p.add_argument("--no-tokens", action="store_true", help="do not print the token/mask view")
    return p


def _token_view(tokenizer: Any, traj: Trajectory) -> Text:
    """The response tokens, each styled by its mask bit; newlines shown as ⏎ so turn boundaries stay visible."""
    out = Text()
    for tid, m in zip(traj.response_ids, traj.response_mask):
        piece = tokenizer.decode([tid], skip_special_tokens=False).replace("\n", "⏎")
        out.append(piece, style=_GENERATED if m else _INSERTED)
        out.append("│", style="grey35")  # token boundary
    return out


def _messages_text(messages: list[Any]) -> Text:
    out = Text()
    for msg in messages:
        out.append(f"{msg.role:>9}: ", style=_ROLE_STYLE.get(msg.role, "white"))
        out.append(msg.content + "\n")
    return out


def render_trajectory(tokenizer: Any, traj: Trajectory, *, title: str, num_prompt_messages: int, tokens: bool) -> Panel:
    mask = traj.response_mask
    generated = [v for v, m in zip(traj.versions, mask) if m]
    stats = Text.assemble(
        ("reward ", "bold"), (f"{traj.reward:.3f}", "bold green" if traj.reward > 0 else "bold red"),
        f"   finish {traj.finish_reason}   turns {traj.num_turns}   tool calls {traj.num_tool_calls}"
        f"   tokens {len(traj.prompt_ids)} prompt + {len(mask)} response ({sum(mask)} generated, "
        f"{len(mask) - sum(mask)} inserted)   versions {min(generated, default=0)}..{max(generated, default=0)}"
        f"   gen {traj.gen_time_s:.2f}s tool {traj.tool_time_s * 1e3:.1f}ms reward {traj.reward_time_s * 1e3:.1f}ms",
    )
    parts: list[Any] = [stats, _messages_text(traj.messages[num_prompt_messages:])]
    if tokens:
        parts += [Text.assemble(("mask 1 (generated, trained on)", _GENERATED), "  ",
                                ("mask 0 (inserted by the environment)", _INSERTED)), _token_view(tokenizer, traj)]
    return Panel(Group(*parts), title=title, title_align="left")


def _summary(results: list[tuple[Any, list[Any]]], seconds: float) -> Table:
    trajs = [t for _, group in results for t in group]
    n = max(len(trajs), 1)
    generated = sum(sum(t.response_mask) for t in trajs)
    table = Table(title="rollout summary", show_header=False)
    table.add_row("prompts x samples", f"{len(results)} x {len(results[0][1]) if results else 0}")
    table.add_row("mean reward", f"{sum(t.reward for t in trajs) / n:.3f}")
    table.add_row("with a tool call", f"{sum(t.num_tool_calls > 0 for t in trajs) / n:.0%}")
    table.add_row("finish reasons", ", ".join(f"{r}: {sum(t.finish_reason == r for t in trajs)}"
                                             for r in ("stop", "length", "max_turns")))
    table.add_row("mean response tokens", f"{sum(len(t.response_ids) for t in trajs) / n:.1f}")
    table.add_row("generated tokens / s", f"{generated / max(seconds, 1e-9):.1f} ({seconds:.2f}s wall)")
    return table


def tools_in_use(cfg: RunConfig, loop: Any, tools: dict[str, Any]) -> str:
    """The tools the run's episodes can call: rollout.tools only under the tool loop, which calls them; a gym or
    verifiers environment and an OpenAI agent bring their own, and a single-turn episode has none."""
    if isinstance(loop, ToolAgentLoop):
        return str(sorted(tools))
    if env_type(cfg) in ("gym", "verifiers"):
        return f"the {env_type(cfg)} environment's"
    return "the agent's own" if cfg.rollout.agent_loop == "openai" else "none"


async def run(cfg: RunConfig, *, num_prompts: int, seed: int, console: Console, tokens: bool = True) -> list:
    """Build everything the producer would, roll out `num_prompts` prompts, print them; returns (task, group)s."""
    stack = build_rollout(cfg, seed=seed)
    model_path, tokenizer, tools, engine, loop = (stack.model_path, stack.tokenizer, stack.tools, stack.engine,
                                                  stack.agent_loop)
    dataset = load_tasks(cfg, tokenizer=tokenizer)
    indices = random.Random(seed).sample(range(len(dataset)), min(num_prompts, len(dataset)))
    # Text, not markup: paths and tool lists hold square brackets that rich would read as style tags.
    console.print(Text.assemble(("rlbus rollout", "bold"),
                                f": model {model_path}, env {env_type(cfg)}, tasks {dataset.name} ({len(dataset)}), "
                                f"agent loop {type(loop).__name__}, tools {tools_in_use(cfg, loop, tools)}, "
                                f"reward {cfg.rollout.reward if env_type(cfg) == 'data' else env_type(cfg)}, "
                                f"n={cfg.rollout.n}"))
    results = []
    started = time.perf_counter()
    try:
        for k, index in enumerate(indices):
            example = dataset[index]
            task = example_to_task(example, task_id=f"dry-{k}", n=cfg.rollout.n)
            group = await loop.rollout_group(task, cfg.rollout.n)
            results.append((task, group))
            console.rule(Text(f"prompt {k + 1}/{len(indices)} (dataset index {index}, "
                              f"ground truth {task.ground_truth!r})"))
            console.print(_messages_text(task.prompt))
            for i, traj in enumerate(group):
                console.print(render_trajectory(tokenizer, traj, title=f"sample {i}",
                                                num_prompt_messages=len(task.prompt), tokens=tokens))
    finally:
        await engine.close()
    console.print(_summary(results, time.perf_counter() - started))
    return results


def main(argv: list[str] | None = None, *, console: Console | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # overrides may come before or after the flags
    if args.num_prompts < 1:
        print("rlbus rollout: --num-prompts must be >= 1", file=sys.stderr)
        return 2
    console = console or Console()
    try:
        cfg = load_config(args.config, args.overrides)
        asyncio.run(run(cfg, num_prompts=args.num_prompts, seed=args.seed, console=console, tokens=not args.no_tokens))
    except (ConfigError, DataError) as e:  # a user's mistake: one clear line, not a traceback
        print(f"rlbus rollout: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
