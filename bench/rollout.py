"""Rollout throughput: the hf engine through the full producer path against bare `model.generate`, same run.

    .venv/bin/python bench/rollout.py                                   # 8 prompts x n=8 x 32 new tokens, 12 rounds
    .venv/bin/python bench/rollout.py --prompts 8 --n 8 --max-new-tokens 32 --rounds 3 --model models/tiny-calc

Builds the quickstart's tiny model (random weights unless --warm-steps, or takes --model DIR), starts an embedded
nats-server and a loopback Ray head, and starts a real in-process `Producer` (hf engine, `single_turn` agent loop).
Then, in alternating rounds over the same N synthetic prompts, three paths produce N groups of n samples:

- producer: N PromptTasks published on the bus -> the Producer pulls each, rolls out n samples in one engine batch,
  puts the tensors in the TransferQueue, publishes the TrajectoryGroup, acks -> the bench pulls the N groups.
  Time: first task published to last group received.
- engine:   `HFEngine.generate` of the producer's engine called directly, one batch of n per prompt (no bus, no
  Ray, no agent loop): separates the cost of the engine's own sampling loop from the plumbing around it.
- bare:     transformers `model.generate(do_sample=True)` of a second copy of the same weights, the prompt rendered
  with the chat template and repeated n times as one batch, same temperature / top-p / top-k / max_new_tokens,
  eos = `<|im_end|>`, `output_scores` off; run in a worker thread, as the engine runs.

Rates are trajectories/s and generated tokens/s (a sample's tokens up to and including its stop token, as the
producer counts them); the figure is producer/bare (target >= 0.8). torch uses the same --threads for all paths.
Writes bench/results/rollout.json and the `## Rollout` section of docs/benchmarks.md (--docs '' skips it).
--profile adds a cProfile of one prompt batch in the engine's loop and in bare generate (top functions by own time).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.common import machine, machine_line, write_section  # noqa: E402
from rlbus.bus.client import Bus  # noqa: E402
from rlbus.bus.loop import run as run_loop  # noqa: E402
from rlbus.bus.ray_cluster import start_ray_head, stop_ray_head  # noqa: E402
from rlbus.bus.server import EmbeddedServer  # noqa: E402
from rlbus.schemas.config import (  # noqa: E402
    BusConfig,
    DataConfig,
    HFEngineConfig,
    LoggingConfig,
    ModelConfig,
    RayConfig,
    RolloutConfig,
    RunConfig,
)
from rlbus.schemas.wire import TrajectoryGroup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Rollout"
TARGET_RATIO = 0.8
PATHS = ("producer", "engine", "bare")


class Round:
    """One path's measurement over the N prompts of one round."""

    cpu_seconds: float = 0.0  # CPU time of this process (all threads; nats-server and Ray workers not counted)

    def __init__(self, path: str, seconds: float, trajectories: int, tokens: int, gen_seconds: float = 0.0):
        self.path, self.seconds, self.trajectories, self.tokens = path, seconds, trajectories, tokens
        self.gen_seconds = gen_seconds  # producer only: time inside engine.generate, as the agent loop recorded it

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "seconds": round(self.seconds, 4), "trajectories": self.trajectories,
                "tokens": self.tokens, "traj_per_s": round(self.trajectories / self.seconds, 2),
                "tokens_per_s": round(self.tokens / self.seconds, 1), "gen_seconds": round(self.gen_seconds, 4),
                "cpu_seconds": round(self.cpu_seconds, 4)}


def run_config(model_dir: Path, server: EmbeddedServer, ray_address: str, args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        name="benchrollout",
        bus=BusConfig(url=server.url, creds_file=str(server.creds_file)),
        ray=RayConfig(address=ray_address, num_storage_actors=1, capacity_bytes=1024**3),
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(type="synthetic", num_examples=args.prompts, seed=0),
        rollout=RolloutConfig(
            engine=HFEngineConfig(max_batch_size=max(16, args.n)),  # one engine batch per group, as bare generate
            agent_loop="single_turn", tools=[], reward="math", n=args.n, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, max_response_tokens=args.max_new_tokens,
            max_inflight_tasks=args.inflight,
        ),  # fmt: skip
        logging=LoggingConfig(level="WARNING", record="off", tensorboard=False, plot=False),
    )


# ---------------------------------------------------------------------------------------------------------------
# the three paths


async def producer_round(bus: Bus, tasks: list, round_no: int) -> Round:
    """Publish the round's tasks and wait for every group; the Producer is already running on the same loop."""
    import msgspec

    s = bus.subjects
    t0 = time.perf_counter()
    for task in tasks:
        task = msgspec.structs.replace(task, task_id=f"r{round_no}-{task.task_id}")
        await bus.publish(s.prompts, task, msg_id=task.task_id)
    got = tokens = trajectories = 0
    gen_seconds = 0.0
    while got < len(tasks):
        try:
            deliveries = await bus.fetch(s.traj, s.traj_consumer, TrajectoryGroup, batch=16, timeout=1.0)
        except TimeoutError:
            # nats-py's batched fetch raises a bare asyncio.TimeoutError (not nats.errors.TimeoutError, which
            # Bus catches) when its first probe outlasts the timeout on a loaded machine: nothing came, go on.
            continue
        for d in deliveries:
            await d.ack()
            group: TrajectoryGroup = d.data
            got += 1
            trajectories += len(group.samples)
            tokens += sum(m.response_len for m in group.samples)
            gen_seconds += max(m.gen_time_s for m in group.samples)  # one batched call per group: same for all
    return Round("producer", time.perf_counter() - t0, trajectories, tokens, gen_seconds)


async def engine_round(engine: Any, prompts: list[list[int]], n: int, params: Any) -> Round:
    t0 = time.perf_counter()
    tokens = 0
    for ids in prompts:
        gens = await engine.generate([ids] * n, params)
        tokens += sum(len(g.token_ids) for g in gens)
    return Round("engine", time.perf_counter() - t0, n * len(prompts), tokens)


def bare_generate(model: Any, ids: list[int], n: int, args: argparse.Namespace, eos: int, pad: int) -> int:
    """One batch of n samples of one prompt with transformers' generate; returns the generated token count."""
    input_ids = torch.tensor([ids] * n, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
            temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
            eos_token_id=eos, pad_token_id=pad, output_scores=False, return_dict_in_generate=False, use_cache=True,
        )  # fmt: skip
    new = out[:, input_ids.shape[1] :]
    total = 0
    for row in new.tolist():  # up to and including the first eos, as the producer counts (finished rows are padded)
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


async def bare_round(model: Any, prompts: list[list[int]], n: int, args: argparse.Namespace, eos: int,
                     pad: int) -> Round:
    t0 = time.perf_counter()
    tokens = 0
    for ids in prompts:
        # In a worker thread, as the engine samples: both paths then run under the same torch thread settings.
        tokens += await asyncio.to_thread(bare_generate, model, ids, n, args, eos, pad)
    return Round("bare", time.perf_counter() - t0, n * len(prompts), tokens)


#: What the engine's loop does per step that bare generate does not: log-probs of the sampled tokens, per-row
#: stopping and the per-row Python bookkeeping (own time of `sample`, which includes int()/float() of elements).
BOOKKEEPING = ("log_softmax", "gather", "isin", "nonzero", "tolist", "hf.py:53(sample)")


def stats_top(prof: cProfile.Profile, limit: int = 14) -> tuple[list[str], pstats.Stats]:
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(limit)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    short = [ln.replace(str(ROOT / ".venv/lib/python3.11/site-packages") + "/", "") for ln in lines[start : start + 1 + limit]]
    return [lines[0].strip()] + short, stats


def profile_calls(fn, repeats: int) -> tuple[list[str], dict[str, float]]:
    """cProfile of `repeats` calls of fn; returns the top lines and {function: own seconds} of BOOKKEEPING."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        fn()
    prof.disable()
    lines, stats = stats_top(prof)
    own: dict[str, float] = {"total": stats.total_tt}  # type: ignore[attr-defined]
    for (file, line, func), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        label = f"{Path(file).name}:{line}({func})" if file != "~" else func
        for key in BOOKKEEPING:
            if key in label:
                own[key] = own.get(key, 0.0) + tottime
    return lines, own


# ---------------------------------------------------------------------------------------------------------------
# the run


async def bench(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.common.chat import prompt_token_ids
    from rlbus.common.data.datasets import example_to_task, load_dataset
    from rlbus.producers.engines.base import SamplingParams
    from rlbus.producers.engines.hf import sample
    from rlbus.producers.service import Producer

    server = EmbeddedServer(work / "bus").start()
    head = start_ray_head(num_cpus=1, object_store_memory=128 * 1024**2)  # main thread: dies with this process
    producer: Producer | None = None
    run_task: asyncio.Task | None = None
    bus: Bus | None = None
    cfg = run_config(model_dir, server, head.address, args)
    try:
        producer = Producer(cfg, "bench")
        await producer.start()
        run_task = asyncio.create_task(producer.run(), name="producer")
        bus = await Bus.connect(cfg.bus, cfg.name, name="bench-rollout")

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        examples = list(load_dataset(cfg.data))[: args.prompts]
        tasks = [example_to_task(ex, task_id=f"p{i}", n=args.n) for i, ex in enumerate(examples)]
        prompts = [prompt_token_ids(tokenizer, ex.prompt) for ex in examples]
        eos = int(tokenizer.eos_token_id)
        pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos
        bare_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        params = SamplingParams(temperature=args.temperature, top_p=1.0, top_k=0,
                                max_new_tokens=args.max_new_tokens, stop_token_ids=(eos,))
        threads_in_worker = await asyncio.to_thread(torch.get_num_threads)

        # Warm-up (not measured): first-call costs of every path (allocator, Ray actor workers, JetStream consumers).
        await producer_round(bus, tasks[:1], -1)
        await engine_round(producer.engine, prompts[:1], args.n, params)
        await bare_round(bare_model, prompts[:1], args.n, args, eos, pad)

        rounds: list[Round] = []
        for r in range(args.rounds):
            order = PATHS if r % 2 == 0 else tuple(reversed(PATHS))  # drift on a shared box hits every path alike
            for path in order:
                cpu0 = time.process_time()
                if path == "producer":
                    rounds.append(await producer_round(bus, tasks, r))
                elif path == "engine":
                    rounds.append(await engine_round(producer.engine, prompts, args.n, params))
                else:
                    rounds.append(await bare_round(bare_model, prompts, args.n, args, eos, pad))
                rounds[-1].cpu_seconds = time.process_time() - cpu0
                log_round(rounds[-1], r)

        profile: dict[str, Any] = {}
        if args.profile:
            reps = 4
            lines, own = profile_calls(
                lambda: sample(producer.engine.model, [prompts[0]] * args.n, params, pad_token_id=pad), reps)
            profile["engine sample()"] = lines
            profile["engine bookkeeping (own s)"] = {k: round(v, 4) for k, v in own.items()}
            profile["bare generate()"] = profile_calls(
                lambda: bare_generate(bare_model, prompts[0], args.n, args, eos, pad), reps)[0]
            # The event-loop thread during a producer round: everything but the generation (a worker thread).
            prof = cProfile.Profile()
            prof.enable()
            await producer_round(bus, tasks, 1000)
            prof.disable()
            profile["producer round, event-loop thread"] = stats_top(prof, limit=20)[0]
    finally:
        if producer is not None:
            producer.stop()
            if run_task is not None:
                await run_task
            await producer.close(reason="bench done")
        if bus is not None:
            await bus.close()
        import ray

        from rlbus.bus.ray_store import teardown

        if ray.is_initialized():
            teardown(cfg.name, cfg.ray)
            ray.shutdown()
        stop_ray_head(head)
        server.stop()
    return summarize(rounds, args, threads_in_worker, profile)


def log_round(r: Round, round_no: int) -> None:
    print(f"round {round_no} {r.path:8s} {r.seconds:7.2f}s {r.trajectories / r.seconds:7.1f} traj/s "
          f"{r.tokens / r.seconds:8.1f} tok/s", flush=True)


def summarize(rounds: list[Round], args: argparse.Namespace, threads_in_worker: int,
              profile: dict[str, Any]) -> dict[str, Any]:
    by_path = {p: [r for r in rounds if r.path == p] for p in PATHS}
    med = {p: {"traj_per_s": statistics.median(r.trajectories / r.seconds for r in rs),
               "tokens_per_s": statistics.median(r.tokens / r.seconds for r in rs),
               "seconds": statistics.median(r.seconds for r in rs),
               "cpu_ms_per_traj": statistics.median(r.cpu_seconds / r.trajectories * 1e3 for r in rs),
               "tokens_per_traj": sum(r.tokens for r in rs) / sum(r.trajectories for r in rs)}
           for p, rs in by_path.items()}  # fmt: skip
    # Ratios per round (paths of one round ran back to back), then the median: less noisy than ratio of medians.
    per_round = [
        {p: next(r for r in rounds[i * 3 : i * 3 + 3] if r.path == p) for p in PATHS} for i in range(args.rounds)
    ]
    ratio = {
        "producer_over_bare_tokens": statistics.median(x["producer"].tokens / x["producer"].seconds
                                                       / (x["bare"].tokens / x["bare"].seconds) for x in per_round),
        "producer_over_bare_traj": statistics.median(x["bare"].seconds / x["producer"].seconds for x in per_round),
        "engine_over_bare_tokens": statistics.median(x["engine"].tokens / x["engine"].seconds
                                                     / (x["bare"].tokens / x["bare"].seconds) for x in per_round),
        # CPU time of this process per generated token, bare / producer: much less disturbed by other load.
        "producer_over_bare_cpu": statistics.median(x["bare"].cpu_seconds / x["bare"].tokens
                                                    / (x["producer"].cpu_seconds / x["producer"].tokens)
                                                    for x in per_round),
        "producer_over_engine_tokens": statistics.median(
            x["producer"].tokens / x["producer"].seconds / (x["engine"].tokens / x["engine"].seconds)
            for x in per_round),
    }  # fmt: skip
    prod = by_path["producer"]
    gen_share = statistics.median(r.gen_seconds / r.seconds for r in prod)
    return {
        "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
        "temperature": args.temperature, "inflight": args.inflight, "torch_threads": args.threads, "torch_threads_in_worker": threads_in_worker,
        "target_ratio": TARGET_RATIO, "paths": med, "ratio": {k: round(v, 3) for k, v in ratio.items()},
        "producer_time_in_engine_generate": round(gen_share, 3),
        "rounds_detail": [r.as_dict() for r in rounds], "profile": profile,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# report


def print_table(res: dict[str, Any]) -> None:
    table = Table(title=f"Rollout: {res['prompts']} prompts x n={res['n']} x {res['max_new_tokens']} new tokens, "
                        f"{res['rounds']} rounds, {res['torch_threads']} torch thread(s)")
    for col in ("path", "traj/s", "tokens/s", "s per round", "tokens/traj", "CPU ms/traj"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for p in PATHS:
        m = res["paths"][p]
        table.add_row(p, f"{m['traj_per_s']:.1f}", f"{m['tokens_per_s']:.0f}", f"{m['seconds']:.2f}",
                      f"{m['tokens_per_traj']:.1f}", f"{m['cpu_ms_per_traj']:.2f}")
    ratio = res["ratio"]["producer_over_bare_tokens"]
    ok = ratio >= TARGET_RATIO
    console = Console(width=120)
    console.print(table)
    console.print(f"producer/bare tokens/s: [{'green' if ok else 'red'}]{ratio:.2f}[/] (target >= {TARGET_RATIO}); "
                  f"trajectories/s {res['ratio']['producer_over_bare_traj']:.2f}; CPU per token "
                  f"{res['ratio']['producer_over_bare_cpu']:.2f}; engine/bare "
                  f"{res['ratio']['engine_over_bare_tokens']:.2f}; producer/engine "
                  f"{res['ratio']['producer_over_engine_tokens']:.2f}; producer time inside engine.generate "
                  f"{res['producer_time_in_engine_generate']:.0%}")
    for name, lines in res["profile"].items():
        print(f"\ncProfile: {name} (sorted by own time)")
        print("\n".join(lines) if isinstance(lines, list) else json.dumps(lines))


def docs_section(res: dict[str, Any], mach: dict[str, Any], command: str) -> str:
    r = res["ratio"]
    verdict = "meets" if r["producer_over_bare_tokens"] >= TARGET_RATIO else "is below"
    rows = [f"| {p} | {res['paths'][p]['traj_per_s']:.1f} | {res['paths'][p]['tokens_per_s']:.0f} | "
            f"{res['paths'][p]['tokens_per_traj']:.1f} | {res['paths'][p]['cpu_ms_per_traj']:.2f} |"
            for p in PATHS]  # fmt: skip
    return "\n".join([
        SECTION,
        "",
        "The hf engine through the full producer path (PromptTask on the bus -> Producer -> single_turn agent loop "
        "-> HFEngine -> TransferQueue put -> TrajectoryGroup published -> task acked -> group pulled) against bare "
        "`model.generate(do_sample=True)` of the same weights on the same prompts (chat template, n samples of a "
        "prompt as one batch, same temperature and max_new_tokens, `output_scores` off), in alternating rounds of "
        "one run. `engine` is `HFEngine.generate` called directly: the engine's own sampling loop without the "
        f"plumbing around it. Command: `{command}`.  ",
        machine_line(mach) + f" torch threads {res['torch_threads']} for every path.  ",
        f"Workload: {res['prompts']} prompts x n={res['n']} x up to {res['max_new_tokens']} new tokens, "
        f"{res['rounds']} rounds, medians; producer rollout.max_inflight_tasks={res['inflight']}.",
        "",
        "| path | trajectories/s | generated tokens/s | tokens/trajectory | CPU ms/trajectory (this process) |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"Producer/bare, tokens/s: **{r['producer_over_bare_tokens']:.2f}** ({verdict} the {TARGET_RATIO} target); "
        f"trajectories/s {r['producer_over_bare_traj']:.2f}; by this process's CPU time per token (steadier on a "
        f"shared machine; excludes nats-server and the Ray shard) {r['producer_over_bare_cpu']:.2f}. Split: engine/bare {r['engine_over_bare_tokens']:.2f} "
        f"(the cost of the engine's own loop: exact log-probs of every sampled token and per-sequence stopping, "
        f"which bare generate does not do) and producer/engine {r['producer_over_engine_tokens']:.2f} (bus, "
        f"TransferQueue, agent loop, reward); {res['producer_time_in_engine_generate']:.0%} of the producer's "
        "time is inside engine.generate. Ratios are per-round medians.",
        "",
    ])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts (= groups) per round")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (one batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=12, help="rounds; each runs every path once, order alternating")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every path")
    p.add_argument("--inflight", type=int, default=1, help="rollout.max_inflight_tasks of the producer")
    p.add_argument("--model", default="", help="a Hugging Face model dir; '' builds the tiny quickstart model")
    p.add_argument("--warm-steps", type=int, default=0, help="warm-start steps of the built model (0 = random)")
    p.add_argument("--profile", action="store_true", help="cProfile one batch of the engine loop and bare generate")
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "rollout.json"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to skip writing the docs")
    args = p.parse_args()
    command = " ".join(["python bench/rollout.py", *sys.argv[1:]])
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="rlbus-bench-rollout-") as tmp:
        work = Path(tmp)
        if args.model:
            model_dir = Path(args.model)
        else:
            from rlbus.common.model.init_model import init_model

            model_dir = init_model(work / "model", steps=args.warm_steps, log=lambda *a: None)
        res = run_loop(bench(args, model_dir, work))
    mach = machine(model=args.model or f"tiny quickstart model ({args.warm_steps} warm-start steps)")
    print_table(res)

    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**res, "machine": mach, "command": command}, indent=2) + "\n")
    if args.docs:
        write_section(SECTION, docs_section(res, mach, command), Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
