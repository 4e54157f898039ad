"""bf16 on CPU: the trainer's step in float32 against bf16 autocast, fused AdamW against the default kernel, and the
vLLM engine's generation in float32 against bfloat16, each pair measured side by side in one process.

    .venv/bin/python bench/bf16.py --part trainer            # SmolLM2-135M and the quickstart's tiny model
    .venv/bin/python bench/bf16.py --part optim              # AdamW step at SmolLM2's size, fused vs foreach
    .venv/bin/python bench/bf16.py --part vllm               # vLLM engine (make vllm) float32 vs bfloat16
    .venv/bin/python bench/bf16.py --docs docs/benchmarks.md # the "## bf16 on CPU" section from the results

Each part adds its numbers to bench/results/bf16.json (other parts' kept); `--docs` only renders.

- trainer: one batch of the model's own samples (temperature 1, prompts of bench/vllm_engine.py for SmolLM2,
  quickstart questions for the tiny model), GRPO groups of 4 with 0/1 rewards. Two TrainEngines from the same
  weights, `trainer.mixed_precision` none and bf16, take `train_step` in turns (so load drift hits both alike).
  Before any step: their log-probs of the response tokens (the bf16 ones are what a bf16 trainer would use as
  proximal log-probs) and the mismatch they imply, KL k3 = mean(exp(lr) - 1 - lr), lr = log p_f32 - log p_bf16.
  After the steps: how far the two trained models moved apart, scored by one float32 engine (learning check).
- optim: AdamW.step over SmolLM2's parameters, FSDP2-sharded at world size 1 as in the trainer, random gradients.
- vllm: the rlbus path of bench/vllm_engine.py (16 concurrent requests, 64 new tokens, temperature 1) on an
  engine started in float32, then one in bfloat16; the sampled tokens' log-probs against the float32 trainer's
  (and the bf16 trainer's) recomputed ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from bench.common import machine, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bf16.json"
MODELS = {"smollm2": ROOT / ".rlbus" / "models" / "smollm2-135m-instruct",
          "tiny": ROOT / ".rlbus" / "models" / "tiny-calculator"}
HEADING = "## bf16 on CPU"


# ---------------------------------------------------------------------------------------------------------------
# shared


def rl_batch(rows: list[tuple[list[int], list[int]]], group_size: int = 4) -> TensorDict:
    """A trainer batch from (prompt, response) token lists: right-padded, GRPO groups, reward 1 on every other."""
    B = len(rows)
    T = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T)
    for i, (p, r) in enumerate(rows):
        n = len(p) + len(r)
        ids[i, :n], attn[i, :n], resp[i, len(p):n] = torch.tensor(p + r), 1, 1.0
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), attn.sum(1) - 1] = (torch.arange(B) % 2 == 0).float()
    return TensorDict({"input_ids": ids, "attention_mask": attn, "position_ids": torch.arange(T)[None] * attn,
                       "response_mask": resp, "rollout_log_probs": -1.0 * resp, "token_level_rewards": rewards,
                       "group_index": torch.arange(B) // group_size}, batch_size=[B])  # fmt: skip


def mismatch(ref_N: torch.Tensor, other_N: torch.Tensor) -> dict[str, float]:
    """|log p_ref - log p_other| (max, mean) and KL k3 with the other as behaviour: mean(exp(lr) - 1 - lr)."""
    lr = (ref_N - other_N).double()
    return {"max_abs": float(lr.abs().max()), "mean_abs": float(lr.abs().mean()),
            "kl_k3": float((lr.exp() - 1 - lr).mean()), "tokens": int(lr.numel())}


def sample_rows(model_dir: Path, questions: list[str], max_new: int, seed: int = 0) -> list[tuple[list, list]]:
    """The model's own answers (HF generate, temperature 1, float32), one per question, cut at its EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.common.chat import encode_chat
    from rlbus.common.model.demos import prompt_messages

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    rows = []
    for q in questions:
        prompt = encode_chat(tok, prompt_messages(q), add_generation_prompt=True)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new, pad_token_id=tok.pad_token_id or 0)  # fmt: skip
        rows.append((prompt, out[0, len(prompt):].tolist()))
    return rows


def update(part: str, value: Any) -> None:
    res = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    res[part] = value
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# trainer


def trainer_part(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import random

    from bench.vllm_engine import QUESTIONS
    from rlbus.common.model.demos import arithmetic_problem
    from rlbus.schemas.config import AlgorithmConfig, TrainerConfig
    from rlbus.trainer.engine import TrainEngine

    model_dir = MODELS[name]
    if name == "smollm2":
        questions, max_new, lr = QUESTIONS[:8], 128, 1e-5
    else:
        rng = random.Random(0)
        questions, max_new, lr = [arithmetic_problem(rng)[0] for _ in range(16)], 64, 1e-4
    t0 = time.perf_counter()
    batch = rl_batch(sample_rows(model_dir, questions, max_new))
    sample_s = time.perf_counter() - t0
    mask = batch["response_mask"] > 0
    algo = AlgorithmConfig()
    engines = {mp: TrainEngine(str(model_dir), TrainerConfig(micro_batch_size=8, lr=lr, mixed_precision=mp),
                               algo, temperature=1.0) for mp in ("none", "bf16")}  # fmt: skip
    logp = {mp: e.compute_log_probs(batch)[mask] for mp, e in engines.items()}
    times: dict[str, list[float]] = {"none": [], "bf16": []}
    metrics: dict[str, list[dict]] = {"none": [], "bf16": []}
    for r in range(args.steps + 1):  # the first of each is warm-up (not timed)
        for mp in (("none", "bf16") if r % 2 == 0 else ("bf16", "none")):
            t = time.perf_counter()
            m = engines[mp].train_step(batch)
            if r > 0:
                times[mp].append(time.perf_counter() - t)
            metrics[mp].append({k: m[k] for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy")})
            print(f"{name} {mp} step {r}: {time.perf_counter() - t:.2f} s", metrics[mp][-1], flush=True)
    # Learning: both trained models scored by the float32 engine (the bf16 one's weights loaded into it).
    trained_f32 = engines["none"].compute_log_probs(batch)[mask]
    initial_f32 = logp["none"]
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    set_model_state_dict(engines["none"].model, get_model_state_dict(engines["bf16"].model))
    trained_bf16 = engines["none"].compute_log_probs(batch)[mask]
    n = batch.batch_size[0]
    return {
        "model": model_dir.name, "num_params": sum(p.numel() for p in engines["none"].model.parameters()),
        "batch": {"sequences": n, "tokens": int(batch["attention_mask"].sum()), "response_tokens": int(mask.sum()),
                  "sample_s": sample_s},
        "lr": lr, "timed_steps": args.steps,
        "step_s": {mp: {"median": statistics.median(t), "min": min(t), "max": max(t), "all": t}
                   for mp, t in times.items()},
        "speedup": statistics.median(times["none"]) / statistics.median(times["bf16"]),
        "logprob_bf16_vs_f32": mismatch(logp["none"], logp["bf16"]),
        "metrics": metrics,
        # how far each run moved its own log-probs, and how far apart the two trained models are (float32 scoring)
        "learning": {"moved_f32": mismatch(initial_f32, trained_f32), "moved_bf16": mismatch(initial_f32, trained_bf16),
                     "trained_bf16_vs_f32": mismatch(trained_f32, trained_bf16)},
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# optimizer


def optim_part(args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from rlbus.trainer.dist import init_distributed
    from rlbus.trainer.parallelize import decoder_layers

    init_distributed("cpu")
    out: dict[str, Any] = {}
    for sharded in (True, False):
        model = AutoModelForCausalLM.from_pretrained(MODELS["smollm2"], dtype=torch.float32)
        if sharded:
            for block in decoder_layers(model):
                fully_shard(block)
            fully_shard(model)
        params = list(model.parameters())
        g = torch.Generator().manual_seed(0)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
            if sharded:  # a DTensor parameter takes a DTensor gradient of the same placement
                from torch.distributed.tensor import distribute_tensor

                p.grad = distribute_tensor(p.grad, p.device_mesh, p.placements)
        opts = {k: torch.optim.AdamW(params, lr=1e-5, fused=(k == "fused"), foreach=(k == "foreach") or None)
                for k in ("fused", "foreach")}  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in opts}
        for r in range(args.steps + 1):
            for k in (list(opts) if r % 2 == 0 else list(opts)[::-1]):
                t = time.perf_counter()
                opts[k].step()
                if r > 0:
                    times[k].append(time.perf_counter() - t)
        key = "fsdp2" if sharded else "plain"
        out[key] = {k: {"median": statistics.median(t), "min": min(t), "max": max(t)} for k, t in times.items()}
        out[key]["speedup"] = out[key]["foreach"]["median"] / out[key]["fused"]["median"]
        out["num_params"] = sum(p.numel() for p in params)
        print(key, out[key], flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# vLLM


async def _vllm_dtype(dtype: str, model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from bench.vllm_engine import rate, rlbus_round
    from rlbus.producers.engines.base import SamplingParams
    from rlbus.producers.engines.vllm import VLLMEngine
    from rlbus.schemas.config import VLLMEngineConfig

    t0 = time.perf_counter()
    engine = VLLMEngine(str(model_dir), VLLMEngineConfig(max_model_len=1024, max_num_seqs=16, dtype=dtype,
                                                         cpu_kv_cache_gib=2), seed=0)  # fmt: skip
    start_s = time.perf_counter() - t0
    await engine.generate(prompts[:2], SamplingParams(max_new_tokens=8))  # warm-up
    samples = []
    for r in range(args.rounds):
        samples.append(await rlbus_round(engine, prompts, args.max_new_tokens))
        print(f"vllm {dtype} round {r}: {samples[-1][1] / samples[-1][0]:.1f} tokens/s", flush=True)
    gens = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens))
    await engine.close()
    return {"start_s": start_s, **rate(samples),
            "rows": [(p, list(g.token_ids), list(g.log_probs)) for p, g in zip(prompts, gens)]}


def vllm_part(args: argparse.Namespace) -> dict[str, Any]:
    from bench.vllm_engine import prompts_for
    from rlbus.schemas.config import AlgorithmConfig, TrainerConfig
    from rlbus.trainer.dist import destroy_distributed
    from rlbus.trainer.engine import TrainEngine

    model_dir = MODELS["smollm2"]
    prompts = prompts_for(model_dir, 16)
    runs = {dtype: asyncio.run(_vllm_dtype(dtype, model_dir, prompts, args)) for dtype in ("float32", "bfloat16")}
    out: dict[str, Any] = {"model": model_dir.name, "concurrency": 16, "max_new_tokens": args.max_new_tokens}
    torch.set_num_threads(2)
    for mp in ("none", "bf16"):  # the trainer's recomputed log-probs of each engine's samples
        engine = TrainEngine(str(model_dir), TrainerConfig(micro_batch_size=8, mixed_precision=mp), AlgorithmConfig(),
                             temperature=1.0)  # fmt: skip
        for dtype, run in runs.items():
            batch = rl_batch([(p, t) for p, t, _ in run["rows"]])
            trainer_N = engine.compute_log_probs(batch)[batch["response_mask"] > 0]
            vllm_N = torch.tensor([x for _, _, lp in run["rows"] for x in lp])
            out.setdefault(dtype, {})[f"vs_trainer_{mp}"] = mismatch(trainer_N, vllm_N)
        destroy_distributed()
        del engine
    for dtype, run in runs.items():
        out[dtype].update({k: run[k] for k in ("start_s", "tokens_per_s", "spread", "rounds")})
    out["speedup"] = out["bfloat16"]["tokens_per_s"] / out["float32"]["tokens_per_s"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# docs


def docs_section(res: dict[str, Any]) -> str:
    """The `## bf16 on CPU` section: one row per measurement, bf16 (or the fused kernel) against float32 (or
    foreach), each pair measured in one process, taking turns; the per-part details are in the results file."""
    loads = ", ".join(f"{part} {res[f'machine_{part}']['load_avg_1m']}" for part in ("trainer", "optim", "vllm")
                      if f"machine_{part}" in res)
    mach = next(res[k] for k in ("machine_trainer", "machine_optim", "machine_vllm") if k in res)
    lines = [HEADING, "",
             "`trainer.mixed_precision: bf16` (bf16 autocast around the forward; float32 master weights, gradients, "
             "AdamW state, output head and log-probs), `trainer.fused_optimizer` and vLLM's `rollout.engine.dtype`, "
             "each against float32 (or the foreach AdamW kernel) in one process, taking turns. Command: "
             "`python bench/bf16.py --part trainer|optim|vllm`, each part alone under `flock /tmp/rlbus-heavy.lock`. "
             f"Machine: {mach['cpu_model']}, {mach['cores']} cores, torch {mach['torch']}; 1-minute load per part: "
             f"{loads}. Medians (vLLM: means over rounds); every step's time and the ranges: "
             "`bench/results/bf16.json`.",
             "",
             "| measure | float32 (foreach) | bf16 (fused) | speedup | bf16 against float32 |", "|---|---|---|---|---|"]
    for r in res.get("trainer", {}).values():
        st, b, lp, le = r["step_s"], r["batch"], r["logprob_bf16_vs_f32"], r["learning"]
        lines.append(f"| trainer step, {r['model']} ({r['num_params'] / 1e6:.1f}M; {b['sequences']} sequences, "
                     f"{b['tokens']} tokens) | {st['none']['median']:.2f} s | {st['bf16']['median']:.2f} s | "
                     f"{r['speedup']:.2f}x | log-probs mean abs {lp['mean_abs']:.4f}, KL k3 {lp['kl_k3']:.1e}; after "
                     f"{r['timed_steps'] + 1} updates the runs moved {le['moved_f32']['mean_abs']:.4f} and "
                     f"{le['moved_bf16']['mean_abs']:.4f}, ending {le['trained_bf16_vs_f32']['mean_abs']:.4f} apart |")
    op = res.get("optim", {})
    for key in ("fsdp2", "plain") if op else ():
        o = op[key]
        lines.append(f"| AdamW step, {op['num_params'] / 1e6:.1f}M parameters "
                     f"({'FSDP2 DTensors, as the trainer' if key == 'fsdp2' else 'plain tensors'}) | "
                     f"{o['foreach']['median'] * 1e3:.0f} ms | {o['fused']['median'] * 1e3:.0f} ms | "
                     f"{o['speedup']:.2f}x | |")
    vl = res.get("vllm", {})
    if vl:
        f32, b16 = vl["float32"], vl["bfloat16"]
        a = b16["vs_trainer_none"]
        lines.append(f"| vLLM generation, {vl['model']}, {vl['concurrency']} requests x {vl['max_new_tokens']} "
                     f"tokens | {f32['tokens_per_s']:.0f} tokens/s | {b16['tokens_per_s']:.0f} tokens/s | "
                     f"{vl['speedup']:.2f}x | log-probs against the float32 trainer's: mean abs {a['mean_abs']:.4f}, "
                     f"KL k3 {a['kl_k3']:.1e} (float32 engine: {f32['vs_trainer_none']['kl_k3']:.0e}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["trainer", "optim", "vllm"], default=None)
    p.add_argument("--models", nargs="+", default=["smollm2", "tiny"], choices=list(MODELS))
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (trainer, optim) after one warm-up")
    p.add_argument("--rounds", type=int, default=2, help="vllm: generation rounds per dtype")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--docs", default="", help="render the section into this file (e.g. docs/benchmarks.md)")
    args = p.parse_args()
    torch.set_num_threads(2)
    if args.part is not None:
        import os

        mach = machine(nproc=os.cpu_count())
        if args.part == "trainer":
            update("trainer", {name: trainer_part(name, args) for name in args.models})
        elif args.part == "optim":
            update("optim", optim_part(args))
        else:
            update("vllm", vllm_part(args))
        update(f"machine_{args.part}", mach)  # each part's own machine line (the load while it ran)
    if args.docs:
        write_section(HEADING, docs_section(json.loads(RESULTS.read_text())), Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
